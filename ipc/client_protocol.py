"""Client <-> scheduler messages: what the SDK, the gateway workers and the data-parallel router send a scheduler,
and what it answers.

Bytes from clients are untrusted: they are decoded with a size limit (``ipc.sockets.MAX_CLIENT_MESSAGE_BYTES``)
through the closed union :data:`ClientToServer`, unknown fields rejected; the limits below bound what a valid
message may ask for (``scheduler_proc/validate.py`` enforces them, naming the field).
"""

from __future__ import annotations

from typing import Literal, Optional, Union

import msgspec

from ipc.message import Msg as _Msg
from ipc.message import TokenLogprobs

PROTOCOL_VERSION = 2

# Limits on what a client may send.  Sampling limits follow vLLM's.
MAX_REQUEST_ID_LEN = 128
MAX_STOP_TOKEN_IDS = 64
MAX_SEED = 2**63 - 1
# Output features: scheduler_proc.validate.validate_output_features enforces them (counts and n: count_problem).
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
MAX_N = 16
# Heartbeats: a peer that has been silent for this many intervals is taken for dead.
HEARTBEAT_MISSES = 4


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """How to pick tokens.  ``temperature`` below 1e-5 (0, say) means greedy (``kernels.sampling_ref.is_greedy``).

    Ranges are checked by :func:`scheduler_proc.validate.validate_generate`: each error names the field, its limit.
    """

    max_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Stop strings, matched on the detokenized output by the scheduler; the text ends before the
    # match, and leaves out the text of a stop token that ended it (EOS, stop_token_ids), unless
    # include_stop_str_in_output (vLLM's rules).
    stop: list[str] = []
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens are out
    # Penalties: repetition (HF/vLLM: prompt and output tokens), frequency and presence (OpenAI:
    # output tokens only); logit_bias adds to the logits of the given token ids.
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    # Log-probabilities of the model's raw distribution (before temperature and penalties):
    # None = none; n >= 0: the sampled (or prompt) token's and the n most likely alternatives.
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    # n completions of the prompt, prefilled once; completion i samples with seed (seed + i) mod 2**63
    # (seed: this one, or a random one when None), so it equals an n=1 request with that seed.
    n: int = 1
    # Structured output, at most one (scheduler_proc/grammar.py): a JSON schema (an object, or its JSON
    # text), a regular expression, one of a list of strings, or a Lark / GBNF grammar.  The output is
    # masked token by token to what the constraint allows; it ends with "stop" only once it is complete.
    json_schema: Union[dict, str, None] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None


class Hello(_Msg, tag="hello"):
    protocol_version: int
    client_name: str = ""
    # True: this client reads TokenDeltas, one message per step with every request's new tokens.
    batch_deltas: bool = False
    # > 0: this client promises a message (a Ping if nothing else) at least this often, in seconds;
    # the server aborts its requests once it has been silent for HEARTBEAT_MISSES intervals.
    heartbeat_s: float = 0.0
    # The server's shared secret (--api-key): required on a tcp:// address when the server has one, and
    # for admin messages (ResetPrefixCache) whenever it has one.
    api_key: str = ""


class ServerInfo(_Msg, tag="server_info"):
    protocol_version: int
    model_name: str
    max_model_len: int
    vocab_size: int
    has_tokenizer: bool  # the server holds tokenizer files: GetTokenizer fetches them
    eos_token_ids: list[int]
    device: str
    dtype: str
    pipeline_depth: int
    batch_deltas: bool = False  # the server will send TokenDeltas (the client asked in its Hello)
    server_id: str = ""  # random per server process: a client that sees another id knows the server restarted


class Generate(_Msg, tag="generate"):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # A resumed request (a data-parallel router re-sends one whose replica died): the output tokens the client
    # already has.  The request continues after them as if it had produced them (max_tokens, min_tokens,
    # penalties, stop strings and seeded sampling count them); only later tokens are sent.  Needs n == 1.
    resume_output_ids: list[int] = []
    # Which completion of an n > 1 request this one is (needs n == 1): seeded seed + completion_index, and its
    # replies carry this index.
    completion_index: int = 0


class Abort(_Msg, tag="abort"):
    request_id: str


class GetStats(_Msg, tag="get_stats"):
    pass


class ResetPrefixCache(_Msg, tag="reset_prefix_cache"):
    """Forget every cached KV block no running request holds (benchmarks); the reply is ServerStats.

    An admin message: on a server with an API key, only a client whose Hello gave the key may send it."""


class GetTokenizer(_Msg, tag="get_tokenizer"):
    """Ask for the server's tokenizer files; the reply is TokenizerFiles (no path of the server's disk is told)."""


class TokenizerFiles(_Msg, tag="tokenizer_files"):
    files: dict[str, bytes]  # file name -> contents (tokenizer.json, tokenizer_config.json, ...)


class ServerStats(_Msg, tag="server_stats"):
    """Pool occupancy and counters: tests use it to prove that nothing leaked."""

    num_kv_blocks: int
    num_free_kv_blocks: int
    num_slots: int
    num_free_slots: int
    num_running: int
    num_waiting: int
    num_draining: int
    num_inflight_steps: int
    steps: int
    requests: int
    preemptions: int = 0
    # Preempted requests that came back, and the sum of their times from readmission to their next token.
    resumes: int = 0
    resume_s_total: float = 0.0
    executor_restarts: int = 0
    api_worker_restarts: int = 0  # HTTP gateway workers that exited while serving and were started again
    draining: bool = False  # a shutdown has begun (or the executor failed for good): no new requests
    # Sums over every returned step (seconds), from its StepResult: t_end - t_start, the GPU's
    # busy time and its idle gaps (CUDA only, else 0), and the executor's wait for plans.
    step_time_s_total: float = 0.0
    gpu_busy_s_total: float = 0.0
    gpu_gap_s_total: float = 0.0
    executor_idle_s_total: float = 0.0
    # Prefix caching: prompt (+ resumed) tokens admissions looked up, and those found cached.
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    # Host KV tier: the part of prefix_cache_hit_tokens found on the host (and onloaded), and its pool.
    prefix_cache_host_hit_tokens: int = 0
    num_host_kv_blocks: int = 0
    num_free_host_kv_blocks: int = 0
    # The executor's device memory (CUDA; 0 before the first sample): the allocator's peak reserved bytes
    # since start-up, and the least free device memory seen while serving.
    device_peak_bytes: int = 0
    device_free_min_bytes: int = 0
    # Structured outputs (scheduler_proc/grammar.py): constrained requests, constraints compiled (not cached),
    # their compile seconds (sum, and counts per bucket of scheduler_proc.grammar.COMPILE_BUCKETS, +Inf last),
    # and requests whose constraint was found compiled in the cache.
    structured_requests: int = 0
    grammar_compiles: int = 0
    grammar_compile_s_total: float = 0.0
    grammar_compile_buckets: list[int] = []
    grammar_cache_hits: int = 0
    # Steps with a constrained row, those whose sampling waited for its masks, and the seconds waited (the
    # executor's host time between the step's forward and its sampling: the GPU idles only past the forward).
    grammar_steps: int = 0
    grammar_wait_steps: int = 0
    grammar_wait_s_total: float = 0.0
    spec_rows: int = 0  # speculative decoding: rows verified, their drafts, the drafts accepted (Finished's sums)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Data-parallel replicas (scheduler_proc/replica_router.py): a replica's index in its own stats; the router's
    # answer holds the sums and, in ``replicas``, each replica's own stats (a replica that is down has none), the
    # indices of the replicas down (restarting, or down for good), and each replica's restarts by index.
    replica: Optional[int] = None
    replicas: list[ServerStats] = []
    replicas_down: list[int] = []
    replica_restarts: list[int] = []


class TokenDelta(_Msg, tag="token_delta"):
    request_id: str
    token_ids: list[int]
    index: int = 0  # which completion of an n > 1 request
    logprobs: list[TokenLogprobs] = []  # one per token, when the request asked
    # Once, with the first delta, when the request asked: position 0 has none (None).
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None


class TokenDeltas(_Msg, tag="token_deltas"):
    """New tokens of several requests of one client, from one step: ``request_ids[i]`` got ``token_ids[i]``.

    Sent instead of one TokenDelta per request to a client whose Hello set ``batch_deltas``: at hundreds of
    running requests, one message per request per step costs the server (and the client) more than the step
    itself.  Each request appears once; its Finished never rides in a batch.
    """

    request_ids: list[str]
    token_ids: list[list[int]]
    indices: list[int] = []  # empty when every entry is completion 0, else one per request
    logprobs: list[list[TokenLogprobs]] = []  # empty, or one list per request (empty when not asked)
    prompt_logprobs: list[Optional[list[Optional[TokenLogprobs]]]] = []  # likewise


FinishReason = Literal["stop", "length", "abort", "error"]


class Finished(_Msg, tag="finished"):
    request_id: str
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    # Tokens not yet sent in a TokenDelta (the last ones), so that a finish never needs a separate delta message.
    token_ids: list[int] = []
    message: str = ""
    logprobs: list[TokenLogprobs] = []  # for token_ids, when the request asked
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None  # if not sent in a delta before
    stop_str: Optional[str] = None  # the stop string that finished the request (reason "stop")
    index: int = 0  # which completion of an n > 1 request (each completion has its own Finished)
    draft_tokens: int = 0  # speculative decoding: its drafts verified, and those accepted (up to its finish)
    accepted_tokens: int = 0


class Error(_Msg, tag="error"):
    """A request (or a frame) was rejected; ``field`` names what was wrong."""

    # "invalid_request", "bad_frame", "protocol" (e.g. a wrong protocol version), "hello_first" (no Hello yet,
    # or forgotten after a silence past its heartbeat), "unauthorized" (no or a wrong api_key), "duplicate_id",
    # "overloaded" (waiting queue full), "shutting_down", "slow_reader" (the client stopped reading),
    # "executor_failed", "internal".
    code: str
    message: str
    request_id: Optional[str] = None
    field: Optional[str] = None


class Ping(_Msg, tag="ping"):
    """Liveness, both ways: the server answers every Ping with a Pong (even before Hello)."""


class Pong(_Msg, tag="pong"):
    server_id: str
    # False: the server does not know this client (no Hello yet, or forgotten after a silence past its
    # heartbeat, its requests aborted): a client that had said Hello must fail its requests and say it again.
    hello: bool = True


def count_problem(s: SamplingParams) -> Optional[tuple[str, str]]:
    """The first count of ``s`` past its limit, as ``(field, message)``; None when every count is within.

    The counts are what a client would loop over before the scheduler sees the request (``n`` completions to set
    up, the stop strings of each) and what the scheduler loops over when it checks the rest (stop token ids,
    logit_bias entries): the SDK checks them before it builds anything, the scheduler before its other checks.
    """
    if not (isinstance(s.n, int) and 1 <= s.n <= MAX_N):
        return "sampling.n", f"n must be in [1, {MAX_N}], got {s.n!r}"
    if len(s.stop) > MAX_STOP_STRINGS:
        return "sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(s.stop)}"
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        return ("sampling.stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, got {len(s.stop_token_ids)}")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        return ("sampling.logit_bias",
                f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed, got {len(s.logit_bias)}")
    return None


ClientToServer = Union[Hello, Generate, Abort, GetStats, Ping, ResetPrefixCache, GetTokenizer]
ServerToClient = Union[ServerInfo, TokenDelta, TokenDeltas, Finished, Error, ServerStats, Pong, TokenizerFiles]

client_request_decoder = msgspec.msgpack.Decoder(ClientToServer)
server_reply_decoder = msgspec.msgpack.Decoder(ServerToClient)
