"""``pie-ctx serve``: the server's command-line entry point.

``register(subparsers)`` adds the ``serve`` subcommand to a parser (the ``pie-ctx`` CLI's,
or ``python -m runtime.server``'s); it sets ``func`` to a handler taking the parsed
``argparse.Namespace`` and returning an exit code. Importing this module has no side
effects and imports neither torch nor the engine (the handler loads them when it runs).
The client-side ``pie-ctx stats`` lives with the program's CLI (``runtime.cli``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import anyio

from pie_ctx.proto.address import (
    Address,
    default_api_key_file,
    default_socket_path,
    new_token,
    read_token_file,
    write_token_file,
)
from pie_ctx.proto.errors import PieError, StorageError
from pie_ctx.proto.framing import DEFAULT_MAX_FRAME_BYTES
from runtime import DETERMINISTIC

__all__ = ["register", "serve_main", "default_snapshot_dir", "DEFAULT_CLIENT_SHARE"]

# A client's contexts may hold at most half of the pool, so one client can never take all
# of it from the others (docs/scheduling.md).
DEFAULT_CLIENT_SHARE = 0.5


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that boot an engine, shared by ``serve`` and ``run``."""
    parser.add_argument("--model", default=None,
                        help="model: default, a short name, an HF folder or a .gguf file")
    parser.add_argument("--page-size", type=int, default=16,
                        help="tokens per KV page (default 16; see docs/forward.md)")
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--num-pages", type=int, default=None, help="KV pool size in pages")
    pool.add_argument("--kv-memory-gb", type=float, default=None, metavar="GB",
                      help="KV pool size in GiB (default 2): as many pages as fit, their "
                           "bytes set by the model and --kv-dtype (docs/pages.md)")
    parser.add_argument("--decode-share", type=float, default=None, metavar="S",
                        help="the share of a step's time running generations keep beside "
                             "prompts, in [0, 1): 0.5 keeps their time between tokens near 2x "
                             "of alone, and delays prompts (default 0: prompt chunks fill each "
                             "step; docs/scheduling.md, \"Decodes' share\")")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)")
    parser.add_argument("--weights", choices=("auto", "fp32", "int8", "gguf"), default="auto",
                        help="auto (default): gguf for a model read from a GGUF on CPU, else "
                             "fp32; fp32: unquantized weights (in --dtype); int8: smoothed int8 "
                             "weights, CPU only (docs/models.md); gguf: the GGUF's own "
                             "blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K; other formats "
                             "dequantized), bit for bit the file's weights, CPU only "
                             "(an HF folder gets Q4_1 blocks made at load; "
                             "docs/performance.md)")
    parser.add_argument("--kv-dtype", choices=("auto", "fp32", "int8", "bf16"), default="auto",
                        help="KV pages: auto (default): bf16 with gguf weights (as llama.cpp "
                             "keeps f16 KV beside its blocks), else fp32; fp32 (unquantized, in "
                             "--dtype), int8 (a scale per token and head; ~3.8x the pages per "
                             "GB) or bf16 (entries rounded to bfloat16, read back in fp32; 2x "
                             "the pages; docs/forward.md)")
    parser.add_argument("--deterministic", choices=("on", "off"),
                        default="on" if DETERMINISTIC else "off",
                        help="on: batch-invariant kernels, the same seed gives the same tokens "
                             "whatever else runs, however the prompt was chunked and whatever "
                             "came from the cache; off: the fastest kernels (default: "
                             f"{'on' if DETERMINISTIC else 'off'}; docs/performance.md)")
    parser.add_argument("--backend", type=_backend_option, default="auto",
                        metavar="{native,transformers,auto}",
                        help="native: pie-ctx's own layers (Llama, Qwen2, Qwen3); transformers: "
                             "transformers' model class over the same pages (any causal LM); "
                             "auto (default): native when it can run the model (docs/models.md)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="shard the model and its KV pages by head over N ranks "
                             "(torch.distributed: gloo on CPU, NCCL on GPU; this process is "
                             "rank 0 and starts the others; docs/scale-out.md)")
    parser.add_argument("--adapter", action="append", default=[], type=_adapter_option,
                        metavar="NAME=PATH",
                        help="load a PEFT LoRA folder as adapter NAME (repeatable; "
                             "Context(rt, adapter=NAME), HTTP model=NAME; docs/adapters.md)")


def _backend_option(value: str) -> str:
    if value in ("asyncio", "trio"):  # what `run --backend` meant before model backends
        raise argparse.ArgumentTypeError(f"{value} is an async library: `run --loop {value}`; "
                                         "--backend picks the model backend")
    if value not in ("native", "transformers", "auto"):
        raise argparse.ArgumentTypeError(f"invalid choice {value!r} (choose from native, "
                                         "transformers, auto)")
    return value


def _adapter_option(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--adapter takes NAME=PATH (a PEFT LoRA folder), "
                                         f"got {value!r}")
    return name, path


def _mcp_option(value: str) -> tuple[str, str]:
    from runtime.server.http.responses.mcp import parse_mcp_option

    try:
        return parse_mcp_option(value)
    except PieError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """``boot_engine`` keyword arguments from :func:`add_engine_arguments`' options."""
    options = {"page_size": args.page_size, "num_pages": args.num_pages, "dtype": args.dtype,
               "weights": args.weights, "kv_dtype": args.kv_dtype, "backend": args.backend,
               "deterministic": args.deterministic == "on"}
    if args.kv_memory_gb is not None:
        options["kv_memory_gb"] = args.kv_memory_gb
    if args.decode_share is not None:
        options["decode_share"] = args.decode_share
    if args.tensor_parallel != 1:
        options["tp"] = args.tensor_parallel
    adapters = dict(getattr(args, "adapter", None) or [])
    if len(adapters) != len(args.adapter or []):
        raise SystemExit("pie-ctx: error: --adapter names must differ")
    if adapters:
        from runtime.model.adapters.peft import check_folder

        for path in adapters.values():  # a bad folder fails now, not after the model loads
            check_folder(path)
        options["adapters"] = adapters
    return options


def register(subparsers: Any) -> None:
    """Add the ``serve`` subcommand to an argparse subparsers object."""
    serve = subparsers.add_parser(
        "serve", help="run the engine as a server for inferlets in other processes",
        description="Serve one engine over a Unix socket (default: in your runtime folder) "
                    "or over TCP (loopback by default; clients need the token).")
    add_engine_arguments(serve)
    serve.add_argument("--socket", default=None, help="Unix socket path to listen on")
    serve.add_argument("--host", default=None, help="TCP host (default 127.0.0.1 with --port)")
    serve.add_argument("--port", type=int, default=None, help="TCP port (0 = pick a free one)")
    serve.add_argument("--token-file", default=None,
                       help="file holding the client token; generated 0600 if missing")
    serve.add_argument("--http", default=None, metavar="[HOST:]PORT",
                       help="also serve the OpenAI-compatible HTTP API, /metrics and the live "
                            "view (docs/http.md); host 127.0.0.1 unless given")
    serve.add_argument("--api-key-file", default=None,
                       help="file holding the HTTP API key; generated 0600 if missing. "
                            "Required (generated) off loopback; on loopback only if given")
    serve.add_argument("--api-key", action="append", default=[], metavar="KEY:SHARE",
                       help="an HTTP API key with its share of the step rows and of the KV "
                            "pool (repeat for each tenant): KEY:SHARE[:PRIORITY[:NAME]], the "
                            "priority of its contexts in [0, 100], its name for /metrics "
                            "(default keyN). See docs/http.md, 'Keys and shares'")
    serve.add_argument("--api-keys-file", default=None, metavar="FILE",
                       help="more --api-key specs, one KEY:SHARE[:PRIORITY[:NAME]] per line "
                            "(# comments); keeps the keys off the command line")
    serve.add_argument("--no-access-log", action="store_true",
                       help="do not write one line per HTTP request (method, path, status, "
                            "ms, tokens) to stderr")
    serve.add_argument("--client-share", type=float, default=DEFAULT_CLIENT_SHARE,
                       help="fraction of the KV pool one client's contexts may hold "
                            f"(default {DEFAULT_CLIENT_SHARE}; 1 = no limit)")
    snaps = serve.add_mutually_exclusive_group()
    snaps.add_argument("--snapshot-dir", default=None, metavar="DIR",
                       help="keep snapshots durable in DIR (it must exist); default: "
                            f"{default_snapshot_dir()} (created if missing). See "
                            "docs/snapshots.md")
    snaps.add_argument("--memory-snapshots", action="store_true",
                       help="keep snapshots in the KV pool only: lost when the server stops")
    serve.add_argument("--disk-cache-gb", type=float, default=4.0,
                       help="with a snapshot directory: disk space for evicted cache pages "
                            "that prefix matching can load back (default 4)")
    serve.add_argument("--shared-snapshots", action="store_true",
                       help="the snapshot directory is shared with other engines of the same "
                            "model (a fleet on one folder, docs/scale-out.md)")
    serve.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                       help="publish KV events (pages stored/removed) in vLLM's schema on "
                            "this ZeroMQ address: tcp://*:5557 binds, tcp://HOST:PORT "
                            "connects (needs pyzmq: pip install 'pie-ctx[ray]')")
    serve.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                       help="with --kv-events: a ROUTER address that replays missed batches")
    serve.add_argument("--inferlets", default=None, metavar="DIR",
                       help="a folder of inferlet files (NAME.py) that clients may launch "
                            "inside the server by name (`pie-ctx launch NAME`, rt.spawn); "
                            "they run with the server's rights (docs/inferlets.md)")
    serve.add_argument("--mcp", action="append", default=[], type=_mcp_option,
                       metavar="NAME=COMMAND|URL",
                       help="an MCP server whose tools HTTP clients of /v1/responses may "
                            "run inside the server ({\"type\": \"mcp\", \"server_label\": "
                            "NAME}): a command started over stdio, or a streamable-HTTP URL "
                            "(repeatable; needs --http; docs/http.md)")
    serve.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                       help="let browser pages from ORIGIN (e.g. http://localhost:3000; * for "
                            "any) call the HTTP API: CORS preflights are answered and replies "
                            "carry Access-Control-Allow-Origin (repeatable; needs --http)")
    serve.add_argument("--tool-hold", type=float, default=None, metavar="SECONDS",
                       help="how long the HTTP API keeps a turn that ends in tool calls held "
                            "in the cache while the client runs them (default 30; 0: not "
                            "held; at most 3600; docs/http.md, \"Caching\")")
    serve.add_argument("--max-frame-bytes", type=int, default=DEFAULT_MAX_FRAME_BYTES,
                       help=argparse.SUPPRESS)
    serve.set_defaults(func=serve_main)


def default_snapshot_dir() -> Path:
    """Where ``serve`` keeps snapshots unless told: ``$XDG_DATA_HOME/pie-ctx/snapshots``,
    else ``~/.local/share/pie-ctx/snapshots`` (user data, like database rows: not a cache)."""
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "share"
    return base / "pie-ctx" / "snapshots"


def _snapshot_options(args: argparse.Namespace) -> dict[str, Any]:
    """``boot_engine`` keyword arguments for the snapshot directory."""
    if args.memory_snapshots:
        if args.shared_snapshots:
            raise PieError("--shared-snapshots needs a snapshot directory, not "
                           "--memory-snapshots")
        return {}
    folder = args.snapshot_dir
    if folder is None:
        folder = default_snapshot_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create the snapshot directory {folder}: {e}; pass "
                               "--snapshot-dir DIR or --memory-snapshots") from None
    return {"snapshot_dir": folder, "disk_cache_gb": args.disk_cache_gb,
            "shared_snapshots": args.shared_snapshots}


def _listen_address(args: argparse.Namespace) -> Address:
    if args.socket is not None and (args.host is not None or args.port is not None):
        raise PieError("give either --socket or --host/--port, not both")
    if args.host is not None or args.port is not None:
        return Address("tcp", host=args.host or "127.0.0.1", port=args.port or 0)
    return Address("unix", path=args.socket or default_socket_path())


def _api_keys(args: argparse.Namespace) -> list[Any]:
    """The keys with shares of ``--api-key`` and ``--api-keys-file``, in that order."""
    from runtime.server.http.keys import check_keys, parse_key, read_keys_file

    keys = [parse_key(spec, f"key{i}") for i, spec in enumerate(args.api_key, 1)]
    if args.api_keys_file is not None:
        keys += read_keys_file(args.api_keys_file, first=len(keys) + 1)
    check_keys(keys)
    return keys


def _http_options(args: argparse.Namespace) -> tuple[Any, str | None, str | None]:
    """(HTTP address or None, API key or None, the key's file or None) from the options."""
    if args.http is None:
        for given, flag in ((args.api_key_file, "--api-key-file"), (args.api_key, "--api-key"),
                            (args.api_keys_file, "--api-keys-file")):
            if given:
                raise PieError(f"{flag} needs --http")
        return None, None, None
    from runtime.server.http.app import is_loopback, parse_http_address

    http = parse_http_address(args.http)
    if args.api_key_file is None and (is_loopback(http.host) or args.api_key
                                      or args.api_keys_file):
        return http, None, None
    path = args.api_key_file or default_api_key_file()
    if os.path.exists(path):
        return http, read_token_file(path), path
    key = new_token()
    write_token_file(path, key)
    return http, key, path


def _say(text: str) -> None:
    print(f"pie-ctx: {text}", file=sys.stderr, flush=True)


def serve_main(args: argparse.Namespace) -> int:
    """Run ``pie-ctx serve`` until SIGINT/SIGTERM; return the exit code (0 on a signal)."""
    from runtime.boot import boot_engine
    from runtime.hosted.folder import InferletFolder
    from runtime.hosted.host import host_inferlets
    from runtime.server.run import run_server, settle_token

    try:
        address = _listen_address(args)
        token, token_file = settle_token(address, None, args.token_file)
        http, api_key, key_file = _http_options(args)
        api_keys = _api_keys(args)
        if args.no_access_log:
            from runtime.server.http.access_log import set_enabled

            set_enabled(False)
        mcp = dict(args.mcp)
        if len(mcp) != len(args.mcp):
            raise PieError("--mcp names must differ")
        if mcp and http is None:
            raise PieError("--mcp needs --http (its tools serve /v1/responses)")
        if args.cors_origin and http is None:
            raise PieError("--cors-origin needs --http")
        if args.tool_hold is not None and not 0 <= args.tool_hold <= 3600:
            raise PieError(f"--tool-hold is seconds from 0 to 3600, got {args.tool_hold:g}")
        folder = None if args.inferlets is None else InferletFolder(args.inferlets)
        if args.kv_events_replay is not None and args.kv_events is None:
            raise PieError("--kv-events-replay needs --kv-events")
        engine = boot_engine(args.model, **engine_options(args), **_snapshot_options(args),
                             owner_share=None if args.client_share >= 1 else args.client_share,
                             kv_events=args.kv_events, kv_events_replay=args.kv_events_replay)
        if folder is not None:
            host_inferlets(engine, folder.path)
    except PieError as err:
        _say(f"error: {err}")
        return 2

    def ready(bound: Address) -> None:
        share = engine.info().max_pages_per_owner
        _say(f"serving {engine.model_name} ({engine.info().backend} backend) on {bound} "
             f"({engine.store.num_pages_total} pages of {engine.store.page_size} tokens"
             f"{f', at most {share} per client' if share else ''})")
        for a in engine.info().adapters:
            _say(f"adapter {a.name}: rank {a.rank} on {', '.join(a.targets)} from {a.path}")
        folder = engine.info().snapshot_dir
        num = engine.store.stats().num_snapshots
        _say(f"snapshots: {num} in {folder}" if folder else
             "snapshots: in memory (lost when the server stops)")
        if engine.host is not None:
            names = engine.host.folder.names()
            _say(f"inferlets: {len(names)} in {engine.host.folder.path}"
                 f"{': ' + ', '.join(names) if names else ''}")
        if engine.kv_events is not None:
            _say(f"kv events on {engine.kv_events.endpoint}"
                 + (f", replay on {engine.kv_events.replay_endpoint}"
                    if engine.kv_events.replay_endpoint else ""))
        if token_file is not None:
            _say(f"clients need the token in {token_file}")

    def http_ready(bound: Any) -> None:
        _say(f"serving HTTP on {bound}")
        if mcp:
            _say(f"MCP servers for /v1/responses: {', '.join(sorted(mcp))}")
        if key_file is not None:
            _say(f"HTTP clients need the API key in {key_file}")
        for key in api_keys:
            _say(f"API key {key.name}: share {key.share:g}, priority {key.priority}")

    try:
        anyio.run(lambda: run_server(engine, address, token=token,
                                     max_frame_bytes=args.max_frame_bytes, ready=ready,
                                     http=http, api_key=api_key, api_keys=api_keys,
                                     http_ready=http_ready,
                                     mcp=mcp, cors_origins=args.cors_origin,
                                     tool_hold_s=args.tool_hold))
    except PieError as err:
        _say(f"error: {err}")
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C while shutting down
        pass
    finally:
        if engine.kv_events is not None:
            engine.kv_events.close()
    _say("stopped")
    return 0
