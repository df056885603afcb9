"""CPU kernels of pie-ctx's own (``cpu_ops.cpp``), built on first use, with eager twins.

Owner: the model runner and the torch attention backend call :func:`ops` and fall back to
their eager PyTorch code when it returns None. The C++ source is compiled once per machine
(``-O3 -march=native``: the flags of the CPU that runs it) into
``~/.cache/pie-ctx/kernels/<digest>/`` by ``torch.utils.cpp_extension`` under an flock
(two processes never build at once; a build killed half-way blocks nobody); the digest
covers the sources, their folder and header, the compiler flags, torch's version and the
CPU's flags, so a cache shared between machines or checkouts never loads a foreign build.

They are on by default; ``PIE_CTX_KERNELS=0`` turns them off (the eager code runs). A
build that fails (no C++ compiler) is logged once and the eager code runs; nothing else
changes. ``python -m runtime.model.kernels`` builds them ahead of time (``make setup``
does); otherwise the first model load does (~25 s).

The kernels (docs/forward.md):

* ``paged_attention``: attention of a few new tokens per sequence (decodes, drafts)
  straight over the paged pool, no gather, split over the keys of long contexts at fixed
  positions (so a row's bits do not depend on its batch);
* ``rms_norm``, ``quantize_rows``, ``rope_``, ``write_kv`` and ``silu_mul``: one pass each
  instead of 2-6 eager ops, bit for bit the eager results;
* ``f32_strips_mm`` and ``int8_strips_mm`` (``strips_mm.cpp``, the same module): projections
  over a weight packed in 16-row strips, row-count invariant by construction
  (``runtime.model.matmul``'s ``f32_strips`` and ``int8_strips``);
* ``DecodeStep`` (``decode_step.cpp``, built into the same module): every layer of a small
  decode batch in one call, with grouped LoRA deltas (``runtime.model.fused_step``
  prepares and runs it).

:func:`block_ops` is a second module from ``block_mm.cpp`` (built the same way, with
``-ffp-contract=fast``): projections over a GGUF file's own Q4_0 / Q4_1 / Q5_0 / Q5_1 /
Q8_0 blocks (``runtime.model.blocks``); its eager twin is dequantizing the blocks and ``F.linear``.
Its ``block_mm_q8`` multiplies them with int8-quantized activations (AVX-512 VNNI where the
CPU has it, portable loops elsewhere); its twin is ``round_activations`` then the same.

:func:`kquant_ops` is another, from ``kquant_mm.cpp`` (built with ``-ffp-contract=off``):
projections over a GGUF file's K-quant super-blocks (Q4_K, Q5_K, Q6_K) read in the file's
own byte layout (``runtime.model.kquants``), exact or on llama.cpp's ``q8_K`` activations.

:func:`sampling_ops` is a third, from ``sampling.cpp`` (built with ``-ffp-contract=off``): a
step's filtered draw (temperature, top-k, top-p, min-p) for every sampled row in one call,
and the distribution it draws from (``runtime.sampling``; its twin is that module's torch
code).

All three include ``vec16.h``: the 16-float vectors and the one vectorised exp (the
paged kernel's softmax with fused multiply-adds, ``silu_mul`` and sampling without), each
rounding fixed in the header whatever the including file's contraction rule. The package
ships the sources and the header (pyproject's package-data): they are compiled where they
run.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["ops", "block_ops", "kquant_ops", "sampling_ops", "enabled", "build", "folder"]

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
BLOCK_SOURCE = Path(__file__).with_name("block_mm.cpp")
SAMPLING_SOURCE = Path(__file__).with_name("sampling.cpp")
KQUANT_SOURCE = Path(__file__).with_name("kquant_mm.cpp")
# the files each module is compiled from: the decode step (runtime/model/fused_step.py)
# and the strip projection kernels (strips_mm.cpp) are built into the cpu_ops module. HEADER is the vectors and the exp all three include:
# part of each build folder's digest, not a compiled source.
HEADER = Path(__file__).with_name("vec16.h")
SOURCES = {SOURCE: (SOURCE, Path(__file__).with_name("decode_step.cpp"),
                   Path(__file__).with_name("strips_mm.cpp")),
           BLOCK_SOURCE: (BLOCK_SOURCE,), SAMPLING_SOURCE: (SAMPLING_SOURCE,),
           KQUANT_SOURCE: (KQUANT_SOURCE,)}
_lock = threading.Lock()
_module: Any = None
_block_module: Any = None
_sampling_module: Any = None
_kquant_module: Any = None
_tried: set[Path] = set()  # the sources whose build was tried (once each)


# Read once: ops() runs several times a layer. Tests flip it with monkeypatch.setattr.
ENABLED = os.environ.get("PIE_CTX_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def enabled() -> bool:
    """False when ``PIE_CTX_KERNELS=0`` (read at import) asks for the eager code."""
    return ENABLED


@functools.cache
def cpu_facts() -> tuple[str, str]:
    """This CPU's model name and feature flags as /proc/cpuinfo gives them (x86 and Arm
    names); ``platform.processor()`` and no flags where it cannot be read. The builds here
    and the measurements ``runtime.model.machine_cache`` keeps are both keyed by them."""
    cpu_model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            name = name.strip()
            if name in ("model name", "Model", "CPU part") and cpu_model == platform.processor():
                cpu_model = value.strip()
            elif name in ("flags", "Features") and not flags:
                flags = value.strip()
    except OSError:
        pass
    return cpu_model, flags


def folder(source: Path = SOURCE, march: str = "native") -> Path:
    """Where this machine's build of ``source`` (for ``-march=march``) lives."""
    digest = hashlib.blake2b(digest_size=8)
    if march != "native":
        digest.update(march.encode())
    # the checkout's own folder: ninja's build files name the sources by absolute path, so
    # two checkouts sharing one build would each rebuild it for the other at every start
    digest.update(str(source.resolve().parent).encode())
    # (this file too: it holds the compiler flags)
    for part in (*(s.read_bytes() for s in SOURCES[source]), HEADER.read_bytes(),
                 Path(__file__).read_bytes(),
                 torch.__version__.encode(),
                 (cpu_facts()[1] or platform.processor()).encode(), platform.machine().encode()):
        digest.update(part)
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "pie-ctx" / "kernels" / digest.hexdigest()


def build(verbose: bool = False, source: Path = SOURCE, march: str = "native") -> Any:
    """Compile (or load the cached build of) the kernels of ``source``; raise if that fails.

    ``march``: on x86, the instruction set to compile for (``"x86-64-v3"``: AVX2 and FMA;
    ``"x86-64"``: SSE2 only, the portable loops), so that tests run the code paths other
    CPUs take; such a build registers no dispatcher ops (``PIE_CTX_NO_DISPATCHER_OPS``: the
    native build owns their names) and is only called through its module."""
    from torch.utils.cpp_extension import load

    where = folder(source, march)
    where.mkdir(parents=True, exist_ok=True)
    # Always the same ninja (the wheel's, beside this interpreter, when there is one): two
    # ninja versions hash a command line differently, so a process that found the
    # system's after one that found the wheel's rebuilt everything (minutes), and back.
    beside = Path(sys.executable).parent
    if (beside / "ninja").exists() or shutil.which("ninja") is None:
        os.environ["PATH"] = f"{beside}{os.pathsep}{os.environ['PATH']}"
    # -fopenmp: at::parallel_for is OpenMP pragmas in ATen's headers, serial without it
    # (libgomp.so.1, the team library torch itself loaded).
    flags = ["-O3", "-std=c++17", "-fopenmp"]
    if platform.machine() in ("x86_64", "AMD64"):
        # the CPU's own instructions; with AVX-512, its full-width registers too
        flags += [f"-march={march}", "-mprefer-vector-width=512"]
    if march != "native":
        flags.append("-DPIE_CTX_NO_DISPATCHER_OPS")
    if source == BLOCK_SOURCE:  # a * b + c as one fma (exact where it matters there)
        flags.append("-ffp-contract=fast")
    elif source in (SAMPLING_SOURCE, KQUANT_SOURCE):  # every rounding as written
        flags.append("-ffp-contract=off")
    elif platform.machine() in ("aarch64", "arm64"):
        flags.append("-mcpu=native")
    # torch's own lock is a file that a process killed mid-build leaves behind, and every
    # later build would wait on it forever. An flock dies with its process: whoever holds
    # it is the only builder, so a torch lock file found then is stale.
    with open(where / "pie-ctx.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (where / "lock").unlink(missing_ok=True)
        stem = "cpu_ops" if source == SOURCE else source.stem
        return load(name=f"pie_ctx_{stem}_{where.name}",
                    sources=[str(s) for s in SOURCES[source]],
                    extra_cflags=flags, extra_ldflags=["-fopenmp"],
                    build_directory=str(where), verbose=verbose)


def _load(source: Path, cache: str, what: str, fallback: str) -> Any:
    """The module built from ``source``, kept in the global ``cache`` (``_module``,
    ``_block_module``, ``_kquant_module`` or ``_sampling_module``: benchmarks/model.py swaps them for
    profiling), or None (turned off, or the build failed: logged once, with ``fallback``
    saying what runs instead)."""
    if not enabled():
        return None
    module = globals()[cache]
    if module is not None or source in _tried:
        return module
    with _lock:
        if source not in _tried:
            _tried.add(source)
            t0 = time.perf_counter()
            try:
                globals()[cache] = build(source=source)
                log.info("%s ready (%.1f s)", what, time.perf_counter() - t0)
            except Exception as err:  # a compiler missing or failing: the eager code runs
                log.warning("pie-ctx's %s did not build (%s); %s", what, err, fallback)
    return globals()[cache]


def ops() -> Any:
    """The compiled kernels, or None (turned off, or the build failed: logged once)."""
    return _load(SOURCE, "_module", "CPU kernels",
                 "using PyTorch ops instead (slower decode)")


def block_ops() -> Any:
    """The compiled block-weight kernels (``block_mm.cpp``), or None (turned off, or the
    build failed: logged once)."""
    return _load(BLOCK_SOURCE, "_block_module", "block-weight kernels",
                 "GGUF block weights run dequantized, through PyTorch (slower)")


def kquant_ops() -> Any:
    """The compiled K-quant kernels (``kquant_mm.cpp``), or None (turned off, or the build
    failed: logged once)."""
    return _load(KQUANT_SOURCE, "_kquant_module", "K-quant kernels",
                 "GGUF K-quant weights run dequantized, through PyTorch (slower)")


def sampling_ops() -> Any:
    """The compiled sampling kernel (``sampling.cpp``), or None (turned off, or the build
    failed: logged once)."""
    return _load(SAMPLING_SOURCE, "_sampling_module", "sampling kernel",
                 "sampling with PyTorch ops instead (slower)")
