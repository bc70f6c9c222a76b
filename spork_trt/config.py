"""Frozen configuration dataclasses. Each default is written once, here; the CLI builds these and hands them over."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real

from spork_trt.errors import FieldError, UserError

from spork_trt.draft_kinds import NGRAM, default_shape, tree_room


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: "linear" or "llama3" (a Hugging Face config's `rope_scaling`), or "factors"
    (llama.cpp's precomputed per-frequency divisors, the `rope_freqs.weight` tensor of llama3 GGUF files)."""

    kind: str  # "linear" | "llama3" | "factors"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    factors: tuple[float, ...] = ()  # [D/2], kind "factors" only


@dataclass(frozen=True)
class Architecture:
    """What a family's decoder does beyond Llama's (read from the checkpoint: checkpoint/families.py). Every engine
    reads this one description; an engine that lacks one of its `features` refuses the checkpoint in one line naming
    it (require). The defaults are Llama's."""

    family: str = "llama"  # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma3" | "phi3"
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head's q and k before the rotary (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and after the MLP too, before each residual add (Gemma 3)
    activation: str = "silu"  # the MLP gate's: "silu" | "gelu_tanh" (Gemma)
    embed_scale: bool = False  # embeddings times sqrt(C) (Gemma)
    query_scale: float = 0.0  # the attention scores' scale; 0: 1 / sqrt(D) (Gemma 3: query_pre_attn_scalar ** -0.5)
    sliding_window: int = 0  # a windowed layer's query attends keys fewer than this many positions back; 0: none
    windowed: tuple[int, ...] = ()  # the layers with the sliding window (local layers)
    local_rope_theta: float = 0.0  # the windowed layers' rope base (Gemma 3); 0: the model's rope_theta
    final_softcap: float = 0.0  # logits = c tanh(logits / c) (0: none)

    def features(self) -> tuple[str, ...]:
        """What this family needs beyond Llama's decoder, by name."""
        have = (("q/k/v biases", self.qkv_bias), ("q/k norms", self.qk_norm),
                ("post-attention and post-MLP norms", self.sandwich_norms),
                ("a GELU-tanh MLP", self.activation != "silu"), ("scaled embeddings", self.embed_scale),
                ("a query scale", self.query_scale != 0.0),
                ("sliding-window attention", self.sliding_window != 0 and bool(self.windowed)),
                ("per-layer rope bases", self.local_rope_theta != 0.0), ("a logit soft-cap", self.final_softcap != 0))
        return tuple(name for name, used in have if used)

    def require(self, supported: frozenset[str], engine: str, fix: str) -> None:
        """Refuse in one line what `engine` cannot run of this family: the features it lacks, and `fix`."""
        lacks = [f for f in self.features() if f not in supported]
        if lacks:
            raise UserError(f"{engine} cannot run a {self.family} checkpoint: it lacks {', '.join(lacks)}; {fix}")


LLAMA = Architecture()
EVERY_FEATURE = frozenset(Architecture(  # what an engine that runs every supported family supports
    qkv_bias=True, qk_norm=True, sandwich_norms=True, activation="gelu_tanh", embed_scale=True, query_scale=1.0,
    sliding_window=1, windowed=(0,), local_rope_theta=1.0, final_softcap=1.0).features())


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder of one of the supported families (`arch`: what it does beyond Llama's)."""

    vocab_size: int
    dim: int  # hidden size
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int  # SwiGLU inner size
    head_dim: int = 0  # 0 means dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 2048  # context window
    tie_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    arch: Architecture = LLAMA

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        assert self.n_heads % self.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads"
        assert self.head_dim % 2 == 0, "RoPE needs an even head_dim"


# The lowest temperature but 0 (greedy). Sampling divides fp32 logits by it: at 1e-38 a logit of 4 overflows to inf
# and softmax gives NaN (the step raised, failing every request in flight); at 0.01 a logit must pass 3.4e36, which no
# model's does. Nothing lower is worth having: at 0.01 a runner-up 0.1 below the top logit is drawn e^-10 as often.
MIN_TEMPERATURE = 0.01
# seeds are 64-bit (torch's generator, Triton's UINT64 seed); a request's drafter draws with seed + 1, which must fit too
SEED_LIMIT = 2**64 - 1
# stop strings per request, and characters per stop string: the stop rule decodes the last 4 x that + 2 tokens at
# every committed token (stopping.StopState.window), so their length bounds its cost
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 64


def _number(field: str, value, integer: bool = False) -> None:
    """A request field must be a real number (an integer where `integer`); bool is not one."""
    if isinstance(value, bool) or not isinstance(value, Integral if integer else Real):
        raise FieldError(field, f"must be {'an integer' if integer else 'a number'}, got {value!r}")


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. temperature 0 means greedy. Validated here, so every front end (CLI, Triton,
    bench) that builds one refuses the same values with the same message."""

    temperature: float = 0.0  # 0 (greedy) or in [MIN_TEMPERATURE, inf)
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # in (0, 1]; 1.0 disables nucleus sampling
    seed: int | None = None  # in [0, SEED_LIMIT); None: a random one

    def __post_init__(self) -> None:
        _number("temperature", self.temperature)
        if not (self.temperature == 0 or (math.isfinite(self.temperature) and self.temperature >= MIN_TEMPERATURE)):
            raise FieldError("temperature", f"must be >= {MIN_TEMPERATURE} and finite, or 0 for greedy, "
                                            f"got {self.temperature}")
        _number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:  # NaN fails too
            raise FieldError("top_p", f"must be in (0, 1], got {self.top_p}")
        _number("top_k", self.top_k, integer=True)
        if self.top_k < 0:
            raise FieldError("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None:
            _number("seed", self.seed, integer=True)
            if not 0 <= self.seed < SEED_LIMIT:
                raise FieldError("seed", f"must be in [0, 2**64 - 1), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerateConfig:
    """One generation request (validated here, as SamplingConfig)."""

    max_new_tokens: int = 256  # >= 1; the engine core clips it to the context window
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _number("max_new_tokens", self.max_new_tokens, integer=True)
        if self.max_new_tokens < 1:
            raise FieldError("max_new_tokens", f"must be a positive number of tokens, got {self.max_new_tokens}")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise FieldError("stop_strings", f"holds {len(self.stop_strings)} strings: at most {MAX_STOP_STRINGS}")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise FieldError("stop_strings", f"must be non-empty text, got {s!r}")
            if len(s) > MAX_STOP_CHARS:
                raise FieldError("stop_strings", f"must be at most {MAX_STOP_CHARS} characters each, got one of "
                                 f"{len(s)}")

    @property
    def greedy(self) -> bool:
        """The one definition of a greedy request: its sampling's temperature is 0."""
        return self.sampling.greedy


DEVICE_DTYPES = ("bf16", "fp16", "fp32")  # the device engine's precisions (--dtype)
CPU_TORCH_DTYPES = ("bf16", "int4")  # the CPU torch engine's (engines/cpu/engine.py; int4: the checkpoint's blocks)
TARGET_DTYPES = DEVICE_DTYPES + ("int4",)  # every --dtype of a torch target (int4 on the CPU only)
AUTO_DTYPE = "auto"  # --dtype: the build's default target on this host (engines/default_target.py)
# fp32 by default: on an H200 (bench/gpu_check.sh, docs/engines.md) fp32 was lossless (trees, batches and the CPU
# engine all gave plain's tokens) and faster for this small model (its forward is launch-bound: 249 vs 193 tokens/s);
# bf16 changed 14 of 16 wide-tree answers and 15 of 16 batched ones (its kernels differ by row count)
DEVICE_DTYPE = "fp32"
VERIFIER_LAYERS = 8  # early-layer verifier depth: 16 calibrates about as well at twice the cost (README)

@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings: the drafter, the tree shape, and recovery."""

    draft: str = NGRAM.name  # a --draft value (draft_kinds.DRAFT_HELP), parsed by draft_kinds.parse_draft
    tree_width: int = NGRAM.shape[0]  # K: top-K children (forks) per expanded node, nodes kept per depth
    tree_depth: int = NGRAM.shape[1]  # M: draft depth
    tree_budget: int = NGRAM.shape[2]  # N: most draft nodes per step
    adaptive: bool = True  # cost-aware pruning, depth halving/regrowth, fall back when slower than plain
    fail_limit: int = 3  # consecutive steps with nothing accepted before falling back to plain decoding
    cooldown: int = 4  # plain steps before probing speculation again
    ngram_max: int = 4  # longest suffix the n-gram drafter matches (it tries down to 1)
    hybrid_min_match: int = 3  # the hybrid drafter uses n-gram drafts only for suffix matches this long
    # store-eagle: the store's tree alone where its best match is this long, else the head's with the store's forks
    store_min_match: int = 3
    verifier: str = "auto"  # auto: score with the calibrated verifier while it pays for itself | on | off
    tau: float = 0.1  # starting pruning threshold on path survival (adapts toward target_acceptance)
    target_acceptance: float = 0.7  # acceptance rate of verified draft nodes that tau steers toward
    gate_tau: float = 0.0  # > 0: lossy gate mode, the verifier alone accepts paths this confident

    @classmethod
    def for_draft(cls, draft: str, width: int | None = None, depth: int | None = None,
                  budget: int | None = None, adaptive: bool = True, **more) -> SpecConfig:
        """The drafter's measured default shape, with any of width/depth/budget (and other fields) overridden."""
        k, m, n = default_shape(draft)
        return cls(draft=draft, tree_width=width or k, tree_depth=depth or m, tree_budget=budget or n,
                   adaptive=adaptive, **more)

    @property
    def tree_room(self) -> int:
        """KV positions past the context one step's tree may take (draft_kinds.tree_room)."""
        return tree_room(self.draft, self.tree_budget, self.tree_depth)
