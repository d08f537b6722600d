"""``forerun serve``'s flags as the one ServerConfig they describe, and the start-up checks of the model folder's
tokenizer files: every bad value a ValueError naming its flag (:mod:`scheduler_proc.launch` prints it in one line)."""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

from ipc.config import ExecutorConfig, ScriptedOptions, SpeculativeConfig, default_of
from scheduler_proc.cli_flags import API_KEY_ENV
from scheduler_proc.flag_checks import check_serve_flags
from scheduler_proc.config import INTERPRETER_HANG_TIMEOUT_S, ServerConfig


def api_key_of(args) -> Optional[str]:
    """The shared secret: --api-key-file, else --api-key, else $FORERUN_API_KEY (None: no key)."""
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                key = f.readline().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file: {e}") from None
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file}: its first line holds no key")
        return key
    env = os.environ.get(API_KEY_ENV)
    if args.api_key is None and env and not env.strip():
        raise ValueError(f"${API_KEY_ENV} is blank, which no HTTP client can send (header values are trimmed): set a "
                         f"key or unset it")
    return args.api_key or env or None


def server_config(args) -> ServerConfig:
    """The one ServerConfig the flags describe; a bad value raises ValueError naming the flag's field."""
    check_serve_flags(args)
    if args.no_prefix_caching:  # the host tier keeps the prefix cache's blocks: a size asked for would do nothing
        given = [f for f, v, d in (("--num-host-kv-blocks", args.num_host_kv_blocks, None),
                                   ("--host-kv-gib", args.host_kv_gib, default_of(ExecutorConfig, "host_kv_gib")))
                 if v != d and v != 0]  # a size of 0: the tier off, as it is
        if given:
            raise ValueError(f"{' and '.join(given)} {'size' if len(given) > 1 else 'sizes'} the host KV tier, which "
                             f"keeps prefix-cache blocks: not with --no-prefix-caching")
    executor = ExecutorConfig(
        load_format=args.load_format, device=args.device, dtype=args.dtype, kernels=args.kernels,
        cuda_graphs=not args.no_cuda_graphs, mixed_graphs=args.mixed_graphs, batch_invariant=args.batch_invariant,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        num_slots=args.max_num_seqs, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=_memory_utilization(args),
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        threads=args.executor_threads, tensor_parallel_size=args.tensor_parallel_size, all_reduce=args.all_reduce,
        enable_expert_parallel=args.enable_expert_parallel, moe_expert_counts=args.moe_expert_counts,
        # The host tier keys its blocks with the prefix cache's keys: without prefix caching it is off.
        host_kv_gib=0.0 if args.no_prefix_caching else args.host_kv_gib,
        num_host_kv_blocks=None if args.no_prefix_caching else args.num_host_kv_blocks,
        host_kv_backup_stream=not args.host_kv_backup_on_compute_stream,
        scripted=ScriptedOptions(step_latency_s=_or_default(args.scripted_step_ms, 1000, ScriptedOptions,
                                                            "step_latency_s") / 1000,
                                 eos_at=dict(args.scripted_eos_at)),
        speculative=SpeculativeConfig(method=args.speculative_method,
                                      num_tokens=_or_default(args.num_speculative_tokens, 1, SpeculativeConfig,
                                                             "num_tokens"),
                                      ngram_min=_or_default(args.ngram_min, 1, SpeculativeConfig, "ngram_min"),
                                      ngram_max=_or_default(args.ngram_max, 1, SpeculativeConfig, "ngram_max"),
                                      draft_model=_draft_path(args.draft_model),
                                      draft_load_format=args.draft_load_format),
    )
    return ServerConfig(model=args.model, tokenizer=args.tokenizer, pipeline_depth=args.pipeline_depth,
                        prefill_ahead=args.prefill_ahead,
                        client_address=args.address, debug_checks=args.debug_checks, step_log=args.step_log,
                        api_key=api_key_of(args), allow_unauthenticated=args.allow_unauthenticated,
                        enable_prefix_caching=not args.no_prefix_caching,
                        executor=executor, executor_hang_timeout_s=_hang_timeout(args),
                        max_restarts=args.max_restarts, restart_window_s=args.restart_window,
                        shutdown_timeout_s=args.shutdown_timeout, max_waiting=args.max_waiting,
                        client_send_hwm=args.client_send_hwm, grammar_compile_timeout_s=args.grammar_compile_timeout)


def _or_default(value, scale, struct: type, name: str):
    """A flag that defaults to None (so that giving it can be told from not: check_serve_flags), or its config
    field's default in the flag's unit (``scale`` flag units per field unit: 1000 for milliseconds of seconds)."""
    return default_of(struct, name) * scale if value is None else value


def _hang_timeout(args) -> float:
    """``--executor-hang-timeout``, or its default: longer where Triton's interpreter runs the kernels (the CPU)."""
    if args.executor_hang_timeout is not None:
        return args.executor_hang_timeout
    if args.kernels == "triton" and args.device == "cpu":
        return INTERPRETER_HANG_TIMEOUT_S
    return default_of(ServerConfig, "executor_hang_timeout_s")


def _draft_path(path: Optional[str]) -> str:
    """--draft-model as an absolute path ("" when not given); ValueError when it does not exist."""
    if not path:
        return ""
    if not os.path.exists(path):
        raise ValueError(f"--draft-model {path!r} does not exist")
    return os.path.abspath(path)


def _memory_utilization(args) -> float:
    """--gpu-memory-utilization, or the deprecated --kv-memory-fraction (with a line saying so)."""
    if args.kv_memory_fraction is not None:
        print("forerun: --kv-memory-fraction is deprecated: it now means --gpu-memory-utilization, the fraction "
              "of the GPU's total memory the server may use", file=sys.stderr, flush=True)
        if args.gpu_memory_utilization is None:
            return args.kv_memory_fraction
    if args.gpu_memory_utilization is not None:
        return args.gpu_memory_utilization
    return default_of(ExecutorConfig, "gpu_memory_utilization")


def check_tokenizer(path: str, tokenizer: Optional[str], model: Optional[str]) -> None:
    """The tokenizer the server detokenizes with loads, and the other JSON files clients build theirs from parse: a
    text file, another format or a malformed file is refused now, in one line naming --tokenizer (or --model, whose
    folder it comes from), not once the model has loaded (a traceback) or in every gateway worker; ValueError."""
    from ipc.models import TOKENIZER_FILES, is_gguf
    from scheduler_proc.outputs import load_detokenizer

    if tokenizer and os.path.isfile(path) and is_gguf(path):
        raise ValueError(f"--tokenizer {tokenizer!r} is a GGUF file, whose tokenizer is not read: give the model's "
                         f"HF tokenizer folder or its tokenizer.json")
    if tokenizer and not (os.path.isfile(path) or any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)):
        # resolve_model checks this for a model's formats; --load-format scripted takes any path
        what = "does not exist" if not os.path.exists(path) else f"has none of {', '.join(TOKENIZER_FILES)}"
        raise ValueError(f"--tokenizer {tokenizer!r} {what}")
    try:
        load_detokenizer(path)
        check_json_files(path)
    except ValueError as e:
        if tokenizer:  # a file given itself is named once
            why = str(e).removeprefix(os.path.abspath(tokenizer) + ": ")
            raise ValueError(f"--tokenizer {tokenizer}: {why}") from None
        raise ValueError(f"--model {model or '(the default model)'}: {e}") from None


def has_chat_template(path: str) -> Optional[bool]:
    """Whether a tokenizer folder holds a chat template (chat_template.jinja or .json, or tokenizer_config.json's
    ``chat_template``); a tokenizer.json file alone has none; None where this cannot tell without loading it (a
    GGUF file's metadata)."""
    if path.endswith(".gguf"):
        return None
    if not os.path.isdir(path):  # a tokenizer.json
        return False
    if any(os.path.isfile(os.path.join(path, f)) for f in ("chat_template.jinja", "chat_template.json")):
        return True
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def chat_template_error(path: str) -> Optional[str]:
    """Why a tokenizer folder's chat template does not compile (jinja2's syntax error, with its line), or None: no
    template, or one that compiles.  Checked once at start-up, so that it is said then, not at every chat request."""
    if not os.path.isdir(path):
        return None
    templates = []
    jinja = os.path.join(path, "chat_template.jinja")
    try:
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                templates.append(f.read())
        for name in ("chat_template.json", "tokenizer_config.json"):
            if os.path.isfile(os.path.join(path, name)):
                with open(os.path.join(path, name), encoding="utf-8") as f:
                    value = json.load(f).get("chat_template")
                # one template, or a list of named ones ({"name": ..., "template": ...})
                named = value if isinstance(value, list) else []
                templates += [value] if isinstance(value, str) else [
                    t["template"] for t in named if isinstance(t, dict) and isinstance(t.get("template"), str)]
    except (OSError, ValueError, AttributeError):
        return None  # unreadable files are check_tokenizer's to refuse
    try:
        import jinja2  # transformers' template engine, with it wherever chat templates render
        import jinja2.ext
    except ImportError:
        return None

    class GenerationTag(jinja2.ext.Extension):
        """transformers' ``{% generation %}...{% endgeneration %}`` (assistant masks): parsed, its body kept."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", GenerationTag])  # as transformers renders them
    for template in templates:
        try:
            env.parse(template)
        except jinja2.TemplateSyntaxError as e:
            return f"{type(e).__name__}: {e.message} (line {e.lineno})"
    return None


def check_json_files(folder: str) -> None:
    """Each JSON file besides tokenizer.json that clients fetch with the tokenizer (ipc.models.TOKENIZER_FILE_NAMES)
    is a JSON object; ValueError naming the first that is not."""
    from ipc.models import TOKENIZER_FILE_NAMES

    if not folder or not os.path.isdir(folder):
        return
    for name in TOKENIZER_FILE_NAMES:
        path = os.path.join(folder, name)
        if name == "tokenizer.json" or not name.endswith(".json") or not os.path.isfile(path):
            continue
        try:  # Python's json, as the loader and transformers read these (it takes Infinity and NaN)
            with open(path, "rb") as f:
                value = json.loads(f.read())
        except OSError as e:
            raise ValueError(f"{path}: {e.strerror or e}") from None
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{path}: not a JSON object")
