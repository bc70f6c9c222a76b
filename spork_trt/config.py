"""Frozen configuration dataclasses. Each default is written once, here; the CLI builds these and hands them over."""
from __future__ import annotations

from dataclasses import dataclass, field

from .draft_kinds import NGRAM, default_shape, tree_room


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
class ModelConfig:
    """Shape of a Llama-family decoder."""

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

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        assert self.n_heads % self.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads"
        assert self.head_dim % 2 == 0, "RoPE needs an even head_dim"


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables nucleus sampling
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class GenerateConfig:
    """One generation request."""

    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_strings: tuple[str, ...] = ()


DEVICE_DTYPES = ("bf16", "fp16", "fp32")  # the device engine's precisions (--dtype)
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
