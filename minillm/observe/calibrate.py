"""This machine's speed, measured once, and what each phase of a request *should* take on it.

A diagnosis that only ranks phases blames whichever is largest, even on a healthy request. To say
"slow", it needs an expectation: from the model's bytes and FLOPs and this machine's measured
rates, how long loading, a prefill of ``n`` tokens and one decode step at context ``c`` should
take. :func:`measure_machine` measures the rates in a few seconds; :func:`machine` caches them
under minillm's cache folder, keyed by a fingerprint of the machine (CPU, cores, memory, NumPy,
BLAS and its threads), so they are measured once per machine (``minillm calibrate`` redoes it).
A measurement taken while other processes kept half a core or more busy (:attr:`Machine.busy`)
describes the neighbours as much as the machine: this process uses it, but it is never kept as the
machine's, so the next process (or ``minillm calibrate``) measures again. ``minillm run`` and
``minillm serve`` measure during the warm-up (``describe_summary.prepare_expectations``), so that
pause is the start's, never a request's step. ``$MINILLM_CALIBRATION`` moves the file (the
test suite points it at a file of its own, so no test reads a user's cached rates).

The rates, each the best of a few runs (the best is the closest to what the hardware gives):

- ``matmul_s_per_byte[m]``: seconds per weight byte of ``x [m, 1024] @ W.T``, ``W`` 96 MiB (three
  times the last-level cache of typical CPUs): a decode step is ``m = 1`` (a matrix-vector product,
  bandwidth bound), a short prompt's prefill a few rows;
- ``gemm_flop_s``: float32 ``[1024, 1024] @ [1024, 1024]``, ``2 n^3`` FLOPs: a long prefill;
- ``fresh_copy_b_s``: copying into freshly allocated memory (page faults + writes): loading
  (the slowest of a few runs: the kernel's cost of fresh pages varies widely);
- ``disk_read_b_s``: reading a file just written and dropped from the page cache
  (``posix_fadvise(DONTNEED)``): a cold load;
- ``tokenizer_b_s``: bytes per second ``tokenizers`` builds a BPE tokenizer from its JSON (a
  synthetic one: 51,000 tokens, 50,000 merges);
- ``call_s``: one small NumPy matrix product (the fixed cost a decoder layer pays ~100 times).

The expectations (:func:`expected_load_s`, :func:`expected_prefill_s`, :func:`expected_tpot_s`)
are roofline-style sums: bytes / rate + FLOPs / rate + calls x overhead. They are estimates; the
diagnosis calls a phase slow only beyond twice its expectation.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from minillm.observe.metrics import blas_summary, cpu_snapshot, others_cpu_share
from minillm.runtime.memory_plan import trim_heap

SCHEMA = "minillm.calibration/3"
#: Cores other processes may keep busy while measuring before the rates say more about them than
#: about this machine (the lessons' rule for asserting a timing: half a core).
BUSY_CORES = 0.5
#: Rows m of the skinny products measured. 2 and 4 too: under OpenBLAS's Haswell kernel a product
#: of 2 to 6 rows streams its weight several times slower than one row, and 8 rows faster than 4
#: (``minillm calibrate`` measures each: ``matmul_s_per_byte``), so 1 and 8 alone made a 5-token prefill's
#: expectation half of what it takes.
ROWS = (1, 2, 4, 8, 64)
K = 1024  # their inner dimension
WEIGHT_BYTES = 96 << 20  # the matrix they stream
#: Calls one decoder layer makes in a decode step, each paying about one small NumPy call's fixed
#: cost: counted with ``sys.setprofile`` on SmolLM2, tuned kernels (48 C and 72 Python functions a
#: layer). With 24, a decode step's expectation left out enough of the step that a healthy request
#: was one scheduling hiccup from being called slow.
CALLS_PER_LAYER = 120


@dataclass
class Machine:
    """Rates measured on this machine (see the module docstring), with what identifies it."""

    fingerprint: dict
    matmul_s_per_byte: dict[str, float]  # {"1": s/byte, "2": ..., "64": ...}
    gemm_flop_s: float
    fresh_copy_b_s: float
    disk_read_b_s: float
    tokenizer_b_s: float
    call_s: float
    seconds: float = 0.0  # how long measuring took
    others_cpu_share: float = float("nan")  # other processes' share of the cores while measuring
    measured_at: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def others_cores(self) -> float:
        """How many cores other processes kept busy while measuring (NaN when unknown)."""
        return self.others_cpu_share * (self.fingerprint.get("cores") or 1)

    @property
    def busy(self) -> bool:
        """Measured while other processes kept :data:`BUSY_CORES` or more cores busy: not kept."""
        return self.others_cores >= BUSY_CORES  # NaN (unknown) compares False

    @property
    def bandwidth_b_s(self) -> float:
        """Bytes per second a matrix-vector product streams (``m = 1``)."""
        return 1.0 / self.matmul_s_per_byte["1"]

    def s_per_byte(self, rows: int) -> float:
        """Seconds per weight byte of a product with ``rows`` rows: interpolated in ``log(rows)``
        between the measured ones, the last one beyond them (FLOPs then bound it: see prefill)."""
        ms = sorted(int(m) for m in self.matmul_s_per_byte)
        rows = min(max(rows, ms[0]), ms[-1])
        for lo, hi in zip(ms, ms[1:], strict=False):
            if lo <= rows <= hi:
                f = (math.log(rows) - math.log(lo)) / (math.log(hi) - math.log(lo))
                a, b = self.matmul_s_per_byte[str(lo)], self.matmul_s_per_byte[str(hi)]
                return a + f * (b - a)
        return self.matmul_s_per_byte[str(ms[-1])]

    def rows(self) -> list[tuple[str, str]]:
        """``(what, value)`` rows for a table."""
        share = self.others_cpu_share
        return [
            ("matrix-vector bandwidth", f"{self.bandwidth_b_s / 1e9:.1f} GB/s"),
            ("GEMM", f"{self.gemm_flop_s / 1e9:.0f} GFLOP/s"),
            ("copy into fresh memory", f"{self.fresh_copy_b_s / 1e9:.1f} GB/s"),
            ("disk read (cold)", f"{self.disk_read_b_s / 1e9:.2f} GB/s"),
            ("tokenizer JSON", f"{self.tokenizer_b_s / 1e6:.0f} MB/s"),
            ("one small NumPy call", f"{self.call_s * 1e6:.1f} us"),
            ("BLAS threads", str(self.fingerprint.get("blas_threads"))),
            ("others' CPU while measuring", "unknown" if share != share else f"{share:.0%} of the cores"),
            ("measured", f"{self.measured_at} in {self.seconds:.1f} s"),
        ]


def fingerprint() -> dict:
    """What must match for cached rates to apply: CPU model, cores, memory, NumPy, BLAS, threads."""
    from minillm.kernels.products import blas_threads

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = 0
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": memory,
        "numpy": np.__version__,
        "blas": blas_summary(),
        "blas_threads": blas_threads(),
    }


def fingerprint_key(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def _best(fn, repeats: int) -> float:
    fn()  # once untimed: caches, thread pools, page faults
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _disk_read_b_s(folder: Path, nbytes: int) -> float:
    """Write ``nbytes`` to a file in ``folder``, drop it from the page cache, time reading it back."""
    folder.mkdir(parents=True, exist_ok=True)
    block = np.random.default_rng(0).integers(0, 255, 16 << 20, dtype=np.uint8).tobytes()
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".calibrate-", delete=False) as f:
        path = Path(f.name)
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: dropped, no root needed
            buf = bytearray(16 << 20)
            t = time.perf_counter()
            with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
                while f.readinto(buf):
                    pass
            return path.stat().st_size / (time.perf_counter() - t)
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)


def _matmul_s_per_byte(rng: np.random.Generator, repeats: int) -> dict[str, float]:
    w = rng.standard_normal((WEIGHT_BYTES // 4 // K, K), dtype=np.float32)  # [rows_w, K]
    per_byte = {}
    for m in ROWS:
        x = rng.standard_normal((m, K), dtype=np.float32)  # [m, K]
        per_byte[str(m)] = _best(lambda x=x: x @ w.T, repeats) / w.nbytes
    return per_byte


def _fresh_copy_b_s(repeats: int) -> float:
    """Copy 256 MiB into a fresh allocation, as a load fills its weight block; the slowest run
    counts. The kernel's cost of finding and zeroing fresh (huge) pages swings widely on a shared
    machine (measured here: 0.04 to 1.3 s for 512 MiB, minutes apart), and a load that paid the
    dear end of that range was not slow: the expectation takes it (lenient, so that a healthy load
    is never a finding)."""
    src = np.ones(64 << 20, dtype=np.float32)  # 256 MiB
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(np.empty_like(src), src)  # a fresh allocation each time: its pages fault in
        times.append(time.perf_counter() - t)
    return src.nbytes / max(times)


def _tokenizer_b_s(repeats: int) -> float:
    from tokenizers import Tokenizer

    base = [chr(0x4E00 + i) for i in range(1000)]  # 1,000 single characters, then 50,000 merged pairs
    merges = [[base[k % 1000], base[k // 1000]] for k in range(50_000)]
    vocab = {t: i for i, t in enumerate(base + [a + b for a, b in merges])}
    model = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "vocab": vocab,
        "merges": merges,
    }
    doc = json.dumps({"version": "1.0", "added_tokens": [], "model": model}, ensure_ascii=False)
    return len(doc.encode()) / _best(lambda: Tokenizer.from_str(doc), repeats)


def measure_machine(folder: Path | None = None, repeats: int = 3) -> Machine:
    """Measure this machine's rates (a few seconds; the BLAS's current threads).

    Args:
        folder: where to write the disk test's temporary file (default minillm's cache folder,
            the disk the models are read from).
        repeats: timed runs per rate; the best counts.

    Returns:
        :class:`Machine`. Rates in bytes/s, FLOP/s; ``call_s`` and ``matmul_s_per_byte`` seconds.

    Raises:
        OSError: neither ``folder`` nor the temporary folder can hold the disk test's 128 MiB file.
    """
    from minillm.sources.hub import cache_root

    t0, cpu0 = time.perf_counter(), cpu_snapshot()
    rng = np.random.default_rng(0)
    per_byte = _matmul_s_per_byte(rng, repeats + 2)
    a = rng.standard_normal((1024, 1024), dtype=np.float32)
    gemm_flop_s = 2 * 1024**3 / _best(lambda: a @ a, repeats)
    fresh_copy_b_s = _fresh_copy_b_s(repeats)
    try:
        disk_read_b_s = _disk_read_b_s(folder or cache_root(), 128 << 20)
    except OSError:  # the cache folder is not writable: the temporary folder's disk instead
        disk_read_b_s = _disk_read_b_s(Path(tempfile.gettempdir()), 128 << 20)
    tokenizer_b_s = _tokenizer_b_s(repeats)
    x, m = np.ones((1, 64), np.float32), np.ones((64, 64), np.float32)
    call_s = _best(lambda: [x @ m for _ in range(1000)], repeats) / 1000
    trim_heap()  # the test arrays and the synthetic tokenizer leave the resident set (a server measures it)
    seconds = time.perf_counter() - t0
    record_measurement("machine", seconds)
    return Machine(
        matmul_s_per_byte=per_byte,
        gemm_flop_s=gemm_flop_s,
        fresh_copy_b_s=fresh_copy_b_s,
        seconds=seconds,
        disk_read_b_s=disk_read_b_s,
        tokenizer_b_s=tokenizer_b_s,
        call_s=call_s,
        fingerprint=fingerprint(),
        others_cpu_share=others_cpu_share(cpu0, cpu_snapshot()),
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
    )


#: Every measurement this process made, oldest first: ``{"what": "machine" | "products_rate", "thread":
#: the thread's name, "seconds": how long it took}``. A server shows the counts in GET /health, so a
#: test can check that a request's step never paid one (``minillm serve`` measures during its warm-up).
MEASUREMENTS: list[dict] = []


def record_measurement(what: str, seconds: float) -> None:
    """Add one measurement to :data:`MEASUREMENTS` (``what``: ``machine`` or ``products_rate``)."""
    MEASUREMENTS.append({"what": what, "thread": threading.current_thread().name, "seconds": seconds})


def measurement_counts() -> dict[str, int]:
    """How many times this process measured the machine and a model's products rate."""
    return {what: sum(m["what"] == what for m in MEASUREMENTS) for what in ("machine", "products_rate")}


def calibration_file() -> Path:
    """Where the rates are cached: ``$MINILLM_CALIBRATION``, else ``calibration.json`` in minillm's
    cache folder."""
    from minillm.sources.hub import cache_root

    if os.environ.get("MINILLM_CALIBRATION"):
        return Path(os.environ["MINILLM_CALIBRATION"]).expanduser()
    return cache_root() / "calibration.json"


def machine_cached() -> tuple[Machine, bool]:
    """:func:`machine`, and whether it was measured just now (a pause the trace should explain)."""
    measured = []
    m = machine(on_measure=lambda: measured.append(True))
    return m, bool(measured)


#: Busy measurements by fingerprint key: used again in this process, never written to the file.
_BUSY: dict[str, Machine] = {}


def machine(*, remeasure: bool = False, on_measure=None) -> Machine:
    """This machine's rates: from the cache when its fingerprint matches, else measured and cached.

    Args:
        remeasure: measure even if cached (``minillm calibrate``).
        on_measure: called with no argument just before measuring (to say why there is a pause).

    The cache is :func:`calibration_file`, one entry per fingerprint (so runs with 1 and 2 BLAS
    threads each have theirs); an unreadable or old file is measured over, an unwritable one costs a
    measurement next time. A measurement on a busy machine (:attr:`Machine.busy`) is kept for this
    process only, never in the file (the next process measures again), and a busy entry left in the
    file by an older version is measured over.
    """
    fp = fingerprint()
    key = fingerprint_key(fp)
    path = calibration_file()
    try:
        cached = json.loads(path.read_text())
        if cached.get("schema") != SCHEMA:
            cached = {"schema": SCHEMA, "machines": {}}
    except (OSError, ValueError):
        cached = {"schema": SCHEMA, "machines": {}}
    if not remeasure and key in cached["machines"]:
        kept = Machine(**cached["machines"][key])
        if not kept.busy:
            return kept
    if not remeasure and key in _BUSY:
        return _BUSY[key]
    if on_measure is not None:
        on_measure()
    m = measure_machine()
    if m.busy:  # the neighbours' figures, not this machine's: this process uses them, the file never
        _BUSY[key] = m  # (a server would otherwise pause every request to measure again)
        return m
    cached["machines"][key] = asdict(m)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)  # atomic: a second process reads the old file or the new one
    except OSError:
        pass  # an unwritable cache costs a re-measure next time, nothing more
    return m


# --- what a phase should take ------------------------------------------------------------------------
def model_sizes(model) -> dict[str, int]:
    """The numbers the expectations use: bytes of the matrices a token streams through (every
    projection and the LM head), parameters in them, bytes of every weight, layers, sizes."""
    w, cfg = model.transformer.weights, model.config
    matrices = [p for layer in w.layers for m in layer.projections() for p in m.parts()]
    layer_params = sum(m.size for m in matrices)
    return {
        "layer_params": layer_params,
        "head_params": w.lm_head.size,
        "matmul_bytes": 4 * (layer_params + w.lm_head.size),
        "weight_bytes": w.nbytes,
        "layers": cfg.num_hidden_layers,
        "q_dim": cfg.q_dim,
        "kv_bytes_per_token": cfg.kv_bytes_per_token(),
    }


def expected_prefill_s(sizes: dict, machine: Machine, tokens: int, products_s_per_byte: float | None = None) -> float:
    """Seconds a prefill of ``tokens`` should take: the layers' products at ``tokens`` rows (the
    slower of streaming their bytes at that row count and their FLOPs at the GEMM rate), attention
    (``4 tokens^2 q_dim`` FLOPs per layer: scores and weighted sum), the LM head for the last
    position (a matrix-vector product), and the per-call overhead. Streaming is slowed by as much
    as the model's own products are slower than the machine's matrix (``products_rate.py``)."""
    slower = max(1.0, (products_s_per_byte or 0.0) / machine.s_per_byte(1))
    layer_bytes = 4 * sizes["layer_params"]
    streamed = layer_bytes * machine.s_per_byte(tokens) * slower
    products = max(streamed, 2 * tokens * sizes["layer_params"] / machine.gemm_flop_s)
    attention = sizes["layers"] * 4 * tokens * tokens * sizes["q_dim"] / machine.gemm_flop_s
    head = 4 * sizes["head_params"] * machine.s_per_byte(1) * slower
    return products + attention + head + sizes["layers"] * CALLS_PER_LAYER * machine.call_s


def expected_tpot_s(sizes: dict, machine: Machine, context: float, products_s_per_byte: float | None = None) -> float:
    """Seconds one decode step at ``context`` cached positions should take: stream every matrix
    once (bandwidth bound; at the model's own products' rate where it is slower, see
    ``products_rate.py``) and read the cache's keys and values, plus the per-call overhead."""
    per_byte = max(machine.s_per_byte(1), products_s_per_byte or 0.0)
    streamed = sizes["matmul_bytes"] * per_byte + sizes["kv_bytes_per_token"] * context * machine.s_per_byte(1)
    return streamed + sizes["layers"] * CALLS_PER_LAYER * machine.call_s


def expected_load_s(model, machine: Machine) -> float:
    """Seconds loading from local files should take: read the weight files from a cold disk and
    copy them twice into fresh memory (eager: out of the file into an array, then into the weight
    block; a memory-mapped load reads only the headers), then build the tokenizer from its file.
    Downloads and conversions are not counted (nothing to expect them from)."""
    w = model.transformer.weights
    file_bytes = sum(f.stat().st_size for f in w.files if f.exists())
    tok = Path(model.path) / "tokenizer.json"
    tok_bytes = tok.stat().st_size if tok.exists() else 0
    eager = file_bytes / machine.disk_read_b_s + 2 * w.nbytes / machine.fresh_copy_b_s
    return (0.0 if w.mapped else eager) + tok_bytes / machine.tokenizer_b_s
