"""Types of the native module built from rust/py (the pyserve-core scheduler)."""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

BACKGROUND_PRIORITY: int
"""Requests of this priority or more are background work: scheduled only in steps that compute
no other request's prompt."""

class ConfigError(ValueError): ...
class InvalidRequestError(ValueError):
    field: str  # the request field at fault, e.g. 'prompt_token_ids', 'max_tokens'

class UnknownRequestError(KeyError): ...
class StepError(RuntimeError): ...

_Ints = Sequence[int] | npt.NDArray[np.integer]

class SchedulerOutput:
    step: int
    req_ids: npt.NDArray[np.uint64]
    num_scheduled_tokens: npt.NDArray[np.int32]
    num_spec_tokens: npt.NDArray[np.int32]
    num_logits: npt.NDArray[np.int32]
    logits_indices: npt.NDArray[np.int32]
    query_start_loc: npt.NDArray[np.int32]
    seq_lens: npt.NDArray[np.int32]
    num_output_tokens: npt.NDArray[np.int32]  # each request's outputs before this step
    input_ids: npt.NDArray[np.int32]
    positions: npt.NDArray[np.int64]
    slot_mapping: npt.NDArray[np.int64]
    tree_parents: npt.NDArray[np.int32]
    block_tables: npt.NDArray[np.int32]
    block_copies: npt.NDArray[np.int32]
    preempted_req_ids: npt.NDArray[np.uint64]
    finished_req_ids: npt.NDArray[np.uint64]
    num_reqs: int
    total_num_tokens: int
    def __len__(self) -> int: ...

class UpdateResult:
    num_appended: npt.NDArray[np.int32]  # per scheduled request
    req_ids: list[int]  # the requests that got tokens
    token_ids: list[int]  # req_ids[i] got token_ids[starts[i]:starts[i + 1]]
    starts: list[int]
    sampled_index: npt.NDArray[np.int64]  # each token's index among the sampled tokens
    num_cached_tokens: dict[int, int]  # requests getting their first tokens -> prefix-cache hits
    finished_req_ids: npt.NDArray[np.uint64]
    finish_reasons: list[str]
    fork_ready: list[int]  # held requests to fork now, then release_hold

class Scheduler:
    def __init__(
        self,
        *,
        num_blocks: int,
        block_size: int = 16,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int = 8192,
        max_loras: int = 4,
        num_lookahead_tokens: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None: ...
    def add_request(
        self,
        request_id: int,
        prompt_token_ids: _Ints,
        *,
        max_tokens: int | None = None,
        min_tokens: int = 0,
        priority: int = 0,
        adapter_id: int = 0,
        cache_salt: str = "",
        stop_token_ids: _Ints | None = None,
        eos_token_id: int | None = None,
        ignore_eos: bool = False,
        hold_for_fork: bool = False,
    ) -> None: ...
    def fork_request(self, parent_id: int, child_id: int) -> None: ...
    def release_hold(self, request_id: int) -> None: ...
    def abort(self, request_id: int) -> None: ...
    def set_spec_tokens(self, request_id: int, token_ids: _Ints, parents: _Ints | None = None) -> None: ...
    def propose_ngram(self, request_id: int, k: int, min_n: int = 1, max_n: int = 4) -> list[int]: ...
    def schedule(self, token_budget: int | None = None, max_background: int | None = None) -> SchedulerOutput:
        """While requests decode, prompts share what the decodes leave of `token_budget` (at
        least `block_size`); the step never exceeds `max_num_batched_tokens`; at most
        `max_background` background requests run in it (None: no limit)."""
    def update(self, sampled_token_ids: _Ints, num_sampled: _Ints) -> UpdateResult: ...
    def has_unfinished_requests(self) -> bool: ...
    def has_foreground_requests(self) -> bool:
        """Whether a request below BACKGROUND_PRIORITY is running or waiting."""
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    def stats(self) -> dict[str, int | float]: ...
    def token_ids(self, request_id: int, start: int = 0) -> npt.NDArray[np.int64]: ...
    def num_cached_tokens(self, request_id: int) -> int: ...
    def request_state(self, request_id: int) -> dict[str, object]: ...
    def check_invariants(self) -> None: ...

def paged_decode_attention(
    q: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    scale: float,
    out: np.ndarray,
    threads: int = 1,
    masks: np.ndarray | None = None,
) -> None:
    """Decode attention on the CPU with the pages read in place: q and out [num_seqs, num_q_heads,
    head_dim] f32, caches [num_blocks, block_size, num_kv_heads, head_dim] f32, block_tables
    [num_seqs, width] int32, seq_lens [num_seqs] int32, masks None or [num_seqs] uint64 (bit b clear
    hides a sequence's key seq_len - 1 - b: a token tree's rows); all C-contiguous. Writes out;
    raises ValueError naming the argument at fault. With `threads` > 1 the sequences are spread over
    the calling thread's OpenMP team (torch's libgomp), where one is loaded."""

def lora_add(
    y: np.ndarray,
    x: np.ndarray,
    token_slots: np.ndarray,
    lora_a: np.ndarray,
    b_scaled: np.ndarray,
    threads: int = 1,
) -> None:
    """Multi-LoRA on the CPU, in place: for each token with a slot (token_slots [tokens] int64,
    -1 = none), y[token] += b_scaled[slot]^T (lora_a[slot] x[token]). y [tokens, fan_out], x
    [tokens, fan_in], lora_a [num_slots, rank, fan_in], b_scaled [num_slots, rank, fan_out] (B
    transposed, times the adapter's scaling), all f32 and C-contiguous. Raises ValueError naming
    the argument at fault. With `threads` > 1 the work is spread over the calling thread's OpenMP
    team (torch's libgomp), where one is loaded."""

def linear(
    x: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None,
    out: np.ndarray,
    threads: int = 1,
) -> None:
    """out [rows, fan_out] = x [rows, fan_in] @ weight [fan_out, fan_in]^T (+ bias [fan_out]), all
    f32 and C-contiguous, out overwritten; the weight is streamed once whatever the number of rows,
    and a row's result has the same bits whatever rows are beside it. Raises ValueError naming the
    argument at fault. With `threads` > 1 the outputs are spread over the calling thread's OpenMP
    team (torch's)."""

def linear_q8(
    x: np.ndarray,
    weight: np.ndarray,
    scales: np.ndarray,
    bias: np.ndarray | None,
    out: np.ndarray,
    threads: int = 1,
) -> None:
    """`linear` with an int8 weight [fan_out, fan_in] and one f32 scale per output channel:
    out = (x @ weight^T) * scales (+ bias), the weight widened to f32 in registers."""

def linear_q4(
    x: np.ndarray,
    packed: np.ndarray,
    scales: np.ndarray,
    offsets: np.ndarray,
    group: int,
    bias: np.ndarray | None,
    out: np.ndarray,
    threads: int = 1,
) -> None:
    """`linear` with 4-bit weights: packed [fan_out, fan_in / 2] uint8 (weight 2j in the low
    nibble of byte j), weight q * scales + offsets per row and group of `group` inputs (scales,
    offsets [fan_out, fan_in / group] f16). Groups of 32 or more: the nibbles multiply x
    quantized to int16 per block of 32 inputs, the offsets x itself."""

def linear_w8a8(
    x: np.ndarray,
    weight: np.ndarray,
    scales: np.ndarray,
    bias: np.ndarray | None,
    out: np.ndarray,
    threads: int = 1,
) -> None:
    """`linear_q8`'s weights with int8 activations: each row of x quantized with a scale sx of its
    own (max |x| / 127, rounded half to even), out = ((xq @ weight^T) * sx) * scales (+ bias),
    the sums exact in int32 (VNNI where the CPU has it): the bits of torch._int_mm followed by
    the same float steps."""

GGUF_BLOCK_SIZES: dict[str, tuple[int, int]]
"""{GGUF type name: (weights, bytes) of a block} for the types the gguf_* functions and the
in-place kernels read."""

def gguf_repack_q4(kind: str, blocks: np.ndarray, packed: np.ndarray, scales: np.ndarray, offsets: np.ndarray,
                   threads: int = 1) -> None:
    """Q4_0 / Q4_1 / Q4_K rows (blocks [rows, row bytes] uint8) as linear_q4's packed [rows,
    fan_in / 2] uint8, scales and offsets [rows, fan_in / 32] f16, written in place. ValueError
    names the argument at fault."""

def gguf_requantize_int8(kind: str, blocks: np.ndarray, q: np.ndarray, scales: np.ndarray,
                         threads: int = 1) -> None:
    """Q8_0 / Q5_0 / Q6_K rows widened with the gguf package's arithmetic and rounded to int8 as
    quantize_int8 rounds: q [rows, fan_in] int8 and scales [rows] f32, written in place."""

def gguf_widen(kind: str, blocks: np.ndarray, out: np.ndarray, threads: int = 1) -> None:
    """Q4_0 / Q4_1 / Q4_K / Q8_0 / Q5_0 / Q6_K rows widened to out [rows, fan_in] f32 with the gguf
    package's arithmetic (its bits), written in place."""

def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    """out = x / sqrt(mean(x^2 over each row) + eps) * weight; rows of len(weight), f32,
    C-contiguous. Raises ValueError naming the argument at fault."""

def add_rms_norm(delta: np.ndarray, residual: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray) -> None:
    """residual += delta in place, then out = rms_norm(residual, weight, eps)."""

def silu_mul(gate_up: np.ndarray, out: np.ndarray) -> None:
    """out [rows, width] = silu(gate_up[:, :width]) * gate_up[:, width:]."""

def rotary(x: np.ndarray, heads: int, head_dim: int, cos: np.ndarray, sin: np.ndarray) -> None:
    """Rotates heads 0..heads of each row of x [rows, width] in place ("rotate half" RoPE), cos
    and sin [rows, head_dim]; the bits of the torch reference `apply_rotary`."""

# (weight f32, bias or None), int8 (weight, scales [fan_out], bias or None), w8a8 (the same and
# "w8a8"), 4-bit (packed, scales f16, offsets f16, group, bias or None): see linear, linear_q8,
# linear_w8a8, linear_q4; or a list of these, their outputs side by side (one fan_in)
Projection = (tuple[np.ndarray, np.ndarray | None] | tuple[np.ndarray, np.ndarray, np.ndarray | None]
              | tuple[np.ndarray, np.ndarray, np.ndarray | None, str]
              | tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray | None] | list)

def decoder_layer(
    x: np.ndarray,
    input_norm: np.ndarray,
    qkv: Projection,
    o: Projection,
    post_norm: np.ndarray,
    gate_up: Projection,
    down: Projection,
    eps: float,
    heads: int,
    head_dim: int,
    kv_heads: int,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    slots: np.ndarray,
    block_tables: np.ndarray,
    seq_lens: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    scale: float,
    threads: int = 1,
    masks: np.ndarray | None = None,
) -> None:
    """One Llama-family decoder layer over a few rows, x [rows, hidden] (the residual stream)
    updated in place: RMSNorm, fused q/k/v projection, rotary, the new K/V written at `slots`, paged
    attention of each row over its own prefix (block_tables [rows, width] int32, seq_lens [rows]
    int32, masks as paged_decode_attention takes them), output projection, residual add + RMSNorm,
    fused gate/up, SiLU product, down projection, residual add. Linears are any `Projection`; caches
    [num_blocks, block_size, kv_heads, head_dim]; cos, sin [rows, head_dim]; all f32 but the index
    arrays. The bits of the same kernels called op by op. Raises ValueError naming what is at fault."""

def model_forward(
    model: object,
    k_caches: list[np.ndarray],
    v_caches: list[np.ndarray],
    feed_tokens: np.ndarray,
    feed_positions: np.ndarray,
    feed_requests: np.ndarray,
    block_tables: np.ndarray,
    logits_rows: np.ndarray,
    aux_layers: np.ndarray,
    threads: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """A whole model over a few rows in one call: the embedding rows, every `decoder_layer`,
    the final RMSNorm and the head; returns the float32 logits [len(logits_rows), vocab] of the
    rows `logits_rows`, and the residual stream entering each layer of `aux_layers` (int64,
    increasing), side by side for every row ([rows, len(aux_layers) * hidden]; [rows, 0] for none). `model` has the attributes of model.whole_model.ModelView (embed, layers,
    norm, eps, head, heads, head_dim, kv_heads, cos, sin [positions, head_dim], scale); rows are
    feed_tokens int32, feed_positions int64 and feed_requests int64 (row i's request, whose block
    table is block_tables[feed_requests[i]]; a request's rows in position order); one cache pair
    a layer. The bits of `decoder_layer`, `rms_norm` and `linear` called one by one. Raises
    ValueError naming what is at fault, before anything is written."""

def greedy_decode(
    model: object,
    k_caches: list[np.ndarray],
    v_caches: list[np.ndarray],
    feed_tokens: np.ndarray,
    feed_positions: np.ndarray,
    feed_requests: np.ndarray,
    block_tables: np.ndarray,
    depth: np.ndarray,
    threads: int = 1,
) -> np.ndarray:
    """A whole model's greedy guesses (a draft model): feeds the rows (as `model_forward`), then
    guesses depth[r] tokens for request r, each the argmax after the token before it, fed back
    for the next. Returns int32 [requests, max(depth)], -1 past a request's depth."""

class ReplicaRouter:
    """The data-parallel front's routing policy (rust/router): a prefix tree of the text sent to
    each replica, their loads (requests in flight) and health."""

    def __init__(
        self,
        num_replicas: int,
        *,
        policy: str = "cache_aware",
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 16,
        balance_rel_threshold: float = 1.5,
        max_tree_bytes: int = 64 << 20,
    ) -> None: ...
    def route(self, text: str, exclude: list[int] = ...) -> tuple[int, str, int] | None:
        """(replica, reason, matched_bytes), counted in flight until finished(replica); None when
        no replica is healthy and not excluded."""
    def finished(self, replica: int) -> None: ...
    def set_healthy(self, replica: int, healthy: bool) -> None: ...
    def is_healthy(self, replica: int) -> bool: ...
    def load(self, replica: int) -> int: ...
    def tree_bytes(self, replica: int) -> int: ...
    @property
    def num_replicas(self) -> int: ...
