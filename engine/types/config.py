"""Engine configuration: frozen, validated at construction."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

# accelerate's placement strategies; anything else must be an explicit {module: device} mapping.
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
DeviceMap = str | dict[str, int | str]


class CompileMode(enum.Enum):
    OFF = "off"
    START = "start"  # compiled before the engine serves: start-up waits (minutes on first use of a machine)
    # Served eagerly at once while a thread compiles; the models switch to their compiled forwards together when
    # every warm-up is done (CPU only: on CUDA the graphs capture the compiled forwards at start-up).
    BACKGROUND = "background"
    # BACKGROUND where compiling was measured to pay (float32 on CPU, with a C++ compiler for inductor), else OFF.
    AUTO = "auto"


class SpeculativeMethod(enum.Enum):
    # Prompt lookup beside whichever drafters are configured: the draft model, the target's early layers, or both.
    HYBRID = "hybrid"
    DRAFT_MODEL = "draft_model"
    NGRAM = "ngram"
    SUFFIX = "suffix"  # suffix tries over the request and recent outputs (engine.speculative.suffix)
    SELF = "self"  # the target's first draft_layers layers draft (engine.speculative.self_draft)
    EAGLE = "eagle"  # draft_model is an EAGLE-3 head reading the target's hidden states (engine.speculative.eagle)
    NONE = "none"


MIN_SCORING_CHUNK = 256  # prompt tokens a scoring request computes per step, at least


@dataclass(frozen=True)
class EngineConfig:
    model: str
    draft_model: str | None = None
    # Self-speculation: the target's first draft_layers layers, final norm and LM head draft (method "self", or
    # "hybrid" beside the lookup and any draft model). None with method "self": the depth of the checkpoint's exit
    # head, else a third of the layers.
    draft_layers: int | None = None
    # Draft through the target checkpoint's trained exit head (MODEL/exit_head/) when it is for draft_layers;
    # False: through the target's own final norm and LM head (engine.models.exit_head).
    exit_head: bool = True
    speculative_method: SpeculativeMethod = SpeculativeMethod.NONE
    # None = adaptive: choose k per sequence per step from acceptance and measured costs.
    num_speculative_tokens: int | None = None
    max_speculative_tokens: int = 8  # upper bound of the adaptive search
    # A lookup's (prompt lookup, suffix decoding) under adaptive k, at least max_speculative_tokens: its drafts cost no
    # forward. At most 31: a sequence feeding more than a short query's 32 tokens is a prompt chunk's forward.
    max_lookup_tokens: int = 24
    ngram_max: int = 4  # n-gram lookup tries n = ngram_max .. ngram_min
    ngram_min: int = 1
    # Suffix decoding's global index keeps the outputs of this many recently ended requests. 1000, not vLLM's 10,000:
    # this host's memory. A never-repeating output token adds ~23 nodes of ~65 bytes in the C trie (31 in the Python
    # fallback; benchmarks/suffix_cost.py), so 1000 outputs of 256 such tokens hold ~380 MB; outputs that repeat one
    # another share nodes.
    suffix_cache_requests: int = 1000
    suffix_max_draft: int = 24  # the longest suffix draft (also at most k and the match length)
    # A model drafter stops a sequence's drafts after one it gave less than this probability (0: never early).
    draft_confidence: float = 0.0
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N: the draft, and the target unless device_map is given
    # The target split across devices by accelerate: a strategy name, or a JSON object / dict of module -> device.
    device_map: DeviceMap | None = None
    # The target sharded over this many ranks (engine.parallel): one process each, rank 0 schedules and drafts.
    tensor_parallel_size: int = 1
    max_model_len: int | None = None  # None = the model's own limit
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # A prompt that arrives while the batch decodes waits up to this many steps for others to arrive, so that they
    # are prefilled in one chunk, when the recent arrival rate says another is due within that time
    # (engine.sched.scheduler). 0 admits every prompt at once.
    prefill_hold_steps: int = 4
    prefill_group_tokens: int = 512  # waiting prompts of this many tokens in all are admitted without waiting
    block_size: int = 16
    num_kv_blocks: int | None = None  # None = from kv_cache_memory_gb, else from the memory plan
    kv_cache_memory_gb: float | None = None  # None = what the memory plan leaves (engine.core.memory_plan)
    # The share of the device specd may use (CUDA, default 0.9), or of available RAM for the KV cache (CPU, 0.25).
    memory_utilization: float | None = None
    seed: int = 0
    trust_remote_code: bool = False
    audit_fraction: float = 0.0  # of finished greedy requests, re-run without speculation and compared
    # torch.compile the decode and verify forwards of the target and the draft: a CompileMode or its value;
    # True and False mean START and OFF.
    compile: CompileMode | str | bool = CompileMode.OFF
    # With compile BACKGROUND: the prompt graphs too, once the decode graphs serve, where none are on disk
    # (engine.worker.prompt_compile); False leaves prompt chunks eager until a start finds them there.
    compile_prompts: bool = True
    # Reuse the KV blocks of a prefix an earlier request computed (engine.sched.block_manager).
    prefix_caching: bool = True
    grammar_drafts: bool = True  # draft the tokens a request's grammar forces, for free (engine.speculative.drafting)
    # Decode and verify forwards padded to static buckets and replayed as CUDA graphs (engine.worker.graphs).
    # None = on where the target runs on one GPU; True on CPU runs the padded forwards eagerly (tests).
    cuda_graphs: bool | None = None
    # How a bucketed forward's attention reads the cache: "flex" through the block table (FlexAttention), "gather"
    # into a padded copy per layer (SDPA), "auto": flex on CUDA, gather on CPU (where it measured faster).
    paged_attention: str = "auto"
    # Keep what exists once the engine is built (and its background compile's graphs) out of garbage collection
    # (engine.core.heap): for a process that holds this engine for its life, as the server does.
    freeze_heap: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.speculative_method, str):
            try:
                object.__setattr__(self, "speculative_method", SpeculativeMethod(self.speculative_method))
            except ValueError:
                valid = ", ".join(m.value for m in SpeculativeMethod)
                raise ValueError(
                    f"speculative_method must be one of {valid}, got {self.speculative_method!r}"
                ) from None
        if not isinstance(self.compile, CompileMode):
            value = {True: "start", False: "off"}.get(self.compile, self.compile)  # type: ignore[call-overload]
            try:
                object.__setattr__(self, "compile", CompileMode(value))
            except ValueError:
                valid = ", ".join(m.value for m in CompileMode)
                raise ValueError(f"compile must be one of {valid}, got {self.compile!r}") from None
        method = self.speculative_method
        if method in (SpeculativeMethod.DRAFT_MODEL, SpeculativeMethod.EAGLE) and not self.draft_model:
            raise ValueError(f"speculative_method={method.value!r} needs draft_model")
        if method is SpeculativeMethod.HYBRID and not self.draft_model and self.draft_layers is None:
            raise ValueError("speculative_method='hybrid' needs draft_model or draft_layers (or both)")
        if self.draft_layers is not None and method not in (SpeculativeMethod.SELF, SpeculativeMethod.HYBRID):
            raise ValueError(f"draft_layers is for speculative_method 'self' or 'hybrid', not {method.value!r}")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise ValueError(f"draft_layers must be >= 1, got {self.draft_layers}")
        if self.num_speculative_tokens is not None and not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [0, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.max_speculative_tokens <= 16:
            raise ValueError(f"max_speculative_tokens must be in [1, 16], got {self.max_speculative_tokens}")
        if not 1 <= self.max_lookup_tokens <= 31:
            raise ValueError(f"max_lookup_tokens must be in [1, 31], got {self.max_lookup_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.suffix_cache_requests < 0:
            raise ValueError(f"suffix_cache_requests must be >= 0, got {self.suffix_cache_requests}")
        if self.suffix_max_draft < 1:
            raise ValueError(f"suffix_max_draft must be >= 1, got {self.suffix_max_draft}")
        if not 0.0 <= self.draft_confidence < 1.0:
            raise ValueError(f"draft_confidence must be in [0, 1), got {self.draft_confidence}")
        if self.memory_utilization is not None and not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.kv_cache_memory_gb is not None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.prefill_hold_steps < 0 or self.prefill_group_tokens < 1:
            raise ValueError("prefill_hold_steps must be >= 0 and prefill_group_tokens >= 1")
        if self.block_size < 1 or self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("block_size, max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0.0 <= self.audit_fraction <= 1.0:
            raise ValueError(f"audit_fraction must be in [0, 1], got {self.audit_fraction}")
        if self.paged_attention not in ("auto", "flex", "gather"):
            raise ValueError(f"paged_attention must be auto, flex or gather, got {self.paged_attention!r}")
        if self.device_map is not None:
            object.__setattr__(self, "device_map", parse_device_map(self.device_map))
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        """What tensor parallelism cannot be combined with, known from the options alone (the model's own limits
        are checked by engine.parallel.checks once its config is read)."""
        size = self.tensor_parallel_size
        if size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
        if size == 1:
            return
        if self.device_map is not None:
            raise ValueError("tensor_parallel_size and device_map both spread the target over devices: give one")
        if self.compile in (CompileMode.START, CompileMode.BACKGROUND):
            raise ValueError(f"compile {self.compile.value!r} is not available with tensor_parallel_size > 1 (the "
                             "sharded forwards run eagerly): use compile 'off' or 'auto'")
        if self.cuda_graphs:
            raise ValueError("cuda_graphs is not available with tensor_parallel_size > 1: leave it unset")
        if self.uses_self_draft:
            # The early layers draft from the target's own weights, which no rank holds whole.
            raise ValueError("self-speculation (draft_layers) is not available with tensor_parallel_size > 1: "
                             "draft with a draft model, n-gram or suffix lookup")

    @property
    def uses_draft_model(self) -> bool:
        """A draft model or an EAGLE head is loaded from ``draft_model`` (engine.core.loader tells them apart)."""
        return self.speculative_method in (SpeculativeMethod.DRAFT_MODEL, SpeculativeMethod.EAGLE) or (
            self.speculative_method is SpeculativeMethod.HYBRID and self.draft_model is not None
        )

    @property
    def uses_self_draft(self) -> bool:
        return self.speculative_method is SpeculativeMethod.SELF or (
            self.speculative_method is SpeculativeMethod.HYBRID and self.draft_layers is not None
        )

    @property
    def uses_lookup(self) -> bool:
        return self.speculative_method in (SpeculativeMethod.NGRAM, SpeculativeMethod.HYBRID)

    @property
    def uses_suffix(self) -> bool:
        return self.speculative_method in (SpeculativeMethod.SUFFIX, SpeculativeMethod.HYBRID)

    @property
    def speculates(self) -> bool:
        return self.speculative_method is not SpeculativeMethod.NONE and self.num_speculative_tokens != 0

    @property
    def logit_rows(self) -> int:
        """The most rows of logits one step computes: every sequence's verify, or a prompt chunk of a request that
        scores its prompt (held to this many tokens: the memory plan reserves for no more)."""
        return max(self.max_num_seqs * (self.k_max + 1), MIN_SCORING_CHUNK)

    @property
    def k_max(self) -> int:
        """The most drafts any sequence may get in one step."""
        if not self.speculates:
            return 0
        return self.num_speculative_tokens if self.num_speculative_tokens is not None else self.max_speculative_tokens


def parse_device_map(value: DeviceMap) -> DeviceMap:
    """A strategy name, or a mapping of module name -> device (a dict, or its JSON text) for
    transformers' ``from_pretrained(device_map=...)``. Offloading is refused: every module of a split
    model must run where its weights are, or its layer's KV cache would sit on the wrong device."""
    if isinstance(value, str) and not value.lstrip().startswith("{"):
        if value not in DEVICE_MAP_STRATEGIES:
            valid = ", ".join(DEVICE_MAP_STRATEGIES)
            raise ValueError(f"device_map must be one of {valid} or a JSON object of module -> device, got {value!r}")
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"device_map is not valid JSON: {exc}") from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f"device_map must be a non-empty mapping of module -> device, got {value!r}")
    for module, device in value.items():
        if not isinstance(module, str) or isinstance(device, bool) or not isinstance(device, (int, str)):
            raise ValueError(f"device_map entry {module!r}: {device!r} must map a module name to a device")
    devices = {str(d) for d in value.values()}
    if "disk" in devices or ("cpu" in devices and len(devices) > 1):
        raise ValueError(
            "device_map places modules on 'cpu' or 'disk' next to other devices, which accelerate treats as "
            "offloading (weights copied in at every forward); specd needs each module on the device it runs on"
        )
    return dict(value)
