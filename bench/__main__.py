import argparse
import sys

from spork_trt.errors import UserError

EXAMPLES = """examples:
  python -m bench plain                      # 8 MT-bench prompts x 128 tokens, ours vs transformers
  python -m bench plain --prompts humaneval --limit 4 --max-new-tokens 64 --json
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pl = sub.add_parser("plain", help="plain greedy tokens/s: ours vs transformers, and the bandwidth bound",
                        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    pl.add_argument("--prompts", default="mt_bench", help="mt_bench | humaneval | PATH.jsonl")
    pl.add_argument("--limit", type=int, default=8)
    pl.add_argument("--max-new-tokens", type=int, default=128)
    pl.add_argument("--model", default=None)
    pl.add_argument("--skip-transformers", action="store_true")
    pl.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        from . import plain

        return plain.main(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


sys.exit(main())
