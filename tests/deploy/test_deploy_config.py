"""A deployment's settings are refused before any replica starts (issue 46), naming the numbers; the
config file is Ray Serve's own; each replica's /metrics samples carry its id.

In this process (no Ray started) and through ``minillm deploy`` (exit status 2, no Ray instance).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml
from deployments import MODEL

import minillm
from minillm.deploy.config import IMPORT_PATH, DeployConfig
from minillm.deploy.metrics import labelled
from minillm.errors import AdapterError, InvalidRequestError, MemoryBudgetError, ModelNotFoundError
from minillm.runtime.memory_plan import MIB


def test_an_unknown_model_is_refused():
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        DeployConfig.from_args({"model": "no-such-model"}).check()


def test_a_budget_smaller_than_one_replica_is_refused_with_its_numbers():
    plan = DeployConfig(model=MODEL).plan()
    with pytest.raises(MemoryBudgetError) as caught:
        DeployConfig.from_args({"model": MODEL, "memory_budget": "100MiB"}).check()
    message = str(caught.value)
    assert "memory_budget is 100.0 MiB" in message
    assert f"at least {plan.total / MIB:,.0f} MiB" in message


def test_more_replicas_than_memory_holds_are_refused_with_the_most_that_fit():
    config = DeployConfig(model=MODEL, replicas=3)
    plan = config.plan()
    with pytest.raises(MemoryBudgetError, match="3 replicas of .* run at most 2 replicas"):
        config.check(available=2 * plan.total + 1)
    assert DeployConfig(model=MODEL, replicas=2).check(available=2 * plan.total + 1).total == plan.total
    auto = DeployConfig(model=MODEL, replicas=1, min_replicas=1, max_replicas=3)
    with pytest.raises(MemoryBudgetError, match="3 replicas"):  # autoscaling's maximum counts
        auto.check(available=2 * plan.total + 1)


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"replicas": 0}, "replicas must be >= 1, got 0"),
        ({"min_replicas": 1}, "needs both min_replicas and max_replicas"),
        ({"min_replicas": 2, "replicas": 1, "max_replicas": 3}, "min_replicas (2) <= replicas (1)"),
        ({"weight_dtype": "int4"}, "weight_dtype 'int4' is not one of"),
        ({"router": "random"}, "router 'random' is not one of"),
        ({"replica": 2}, "unknown deploy setting(s) replica"),
    ],
)
def test_settings_out_of_range_are_named(settings, words):
    with pytest.raises(InvalidRequestError) as caught:
        DeployConfig.from_args({"model": MODEL, **settings}).check(available=10**15)
    assert words in str(caught.value)


#: Ray Serve's own check of a config file (what `serve deploy` validates), run apart: importing Ray
#: would keep about 0.1 GB in the test process for the rest of the run (the RSS budget).
RAY_SCHEMA_CHECK = """
import sys, yaml
from ray.serve.schema import ServeDeploySchema
schema = ServeDeploySchema.model_validate(yaml.safe_load(open(sys.argv[1])))
print(schema.applications[0].import_path, schema.http_options.port)
"""


def test_the_config_file_is_ray_serves_own(tmp_path):
    config = DeployConfig(model=MODEL, replicas=2, threads=1, weight_dtype="int8")
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(config.serve_config(port=8123)))
    run = subprocess.run([sys.executable, "-c", RAY_SCHEMA_CHECK, str(path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [IMPORT_PATH, "8123"]
    assert DeployConfig.from_file(path) == config


def test_refused_by_the_command_before_ray_starts(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "minillm", "deploy", MODEL, "--replicas", "1000", "--port", "8999"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "1000 replicas of smollm2-135m-instruct need" in run.stderr
    assert "Ray" not in run.stdout + run.stderr.split("error:")[0]  # no local Ray instance was started


def test_every_metrics_sample_carries_the_replica_id():
    text = b'# HELP a x\n# TYPE a counter\na_total 3.0\nb{reason="eos"} 2.0\n'
    assert labelled(text, "r1").decode().splitlines() == [
        "# HELP a x",
        "# TYPE a counter",
        'a_total{replica="r1"} 3.0',
        'b{replica="r1",reason="eos"} 2.0',
    ]


def test_without_ray_the_command_names_the_deploy_extra(monkeypatch, capsys):
    from minillm.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray Serve were not installed
    assert main(["deploy", MODEL]) == 2
    err = capsys.readouterr().err
    assert "MissingExtraError" in err and "deploy extra" in err and "ray" in err


@pytest.mark.parametrize("broken", ["missing", "no-config"])
def test_an_adapter_folder_that_is_no_adapter_is_refused_naming_the_path_and_the_fix(tmp_path, broken):
    folder = tmp_path / "lora"
    if broken == "no-config":
        folder.mkdir()
    with pytest.raises(AdapterError) as caught:
        DeployConfig.from_args({"model": MODEL, "adapters": [str(folder)]}).check(available=10**15)
    fix = {
        "missing": f"adapter folder {folder} does not exist; pass the folder PEFT's save_pretrained wrote",
        "no-config": f"{folder / 'adapter_config.json'} is missing; a PEFT adapter folder holds adapter_config.json",
    }[broken]
    assert str(caught.value).startswith(f"deploy config: adapters: {fix}")


def test_adapters_with_packed_gguf_weights_are_refused_before_any_folder_is_read(tmp_path):
    """A LoRA delta cannot be merged into packed GGUF blocks: refused by the check, with load's fix."""
    config = DeployConfig.from_args({"model": MODEL, "weight_dtype": "gguf", "adapters": [str(tmp_path / "lora")]})
    with pytest.raises(InvalidRequestError) as caught:
        config.check(available=10**15)
    assert str(caught.value) == (
        "deploy config: adapters cannot be merged into weight_dtype gguf: the weights stay packed GGUF blocks, "
        "and a LoRA delta is merged into float32 rows; use weight_dtype float32, bfloat16 or int8"
    )
    with pytest.raises(InvalidRequestError, match="weight_dtype='gguf' keeps the GGUF's blocks packed"):
        minillm.load(MODEL, weight_dtype="gguf", adapters=[tmp_path / "lora"])  # the load refuses it as well


def test_adapters_are_absolute_replica_settings_in_the_config_file(tmp_path, monkeypatch):
    """Relative folders are made absolute (the replicas read them from other processes); a change of
    adapters changes the replicas' settings, so Ray rolls the replicas (as for weight_dtype)."""
    monkeypatch.chdir(tmp_path)
    config = DeployConfig(model=MODEL, adapters=["lora"])
    assert config.adapters == [str(tmp_path / "lora")]
    assert config.replica_settings()["adapters"] == [str(tmp_path / "lora")]
    assert config.replica_settings() != DeployConfig(model=MODEL).replica_settings()
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(config.serve_config()))
    assert yaml.safe_load(path.read_text())["applications"][0]["args"]["adapters"] == [str(tmp_path / "lora")]
    assert DeployConfig.from_file(path) == config
    assert DeployConfig(model=MODEL).adapters == []


def test_the_command_refuses_a_missing_adapter_before_ray_starts(tmp_path):
    missing = tmp_path / "no-such-lora"
    run = subprocess.run(
        [sys.executable, "-m", "minillm", "deploy", MODEL, "--adapter", str(missing), "--port", "8999"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert run.returncode == 2
    message = " ".join(run.stderr.split())
    assert f"error: AdapterError: deploy config: adapters: adapter folder {missing} does not exist" in message
    assert "Ray" not in run.stdout + run.stderr.split("error:")[0]  # no local Ray instance was started
