"""config.toml validation, repository layout and ``check_repository``."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import numpy as np
import pytest

from harness.repo_utils import bits_input, model_toml, tensor, write_model_folder
from service.models.builder import check_repository as _check_repository
from service.models.config import DEFAULT_MAX_OPERATOR_BYTES, ConfigError, load_config, parse_config
from service.models.demo import DEMO_CONFIG_TOML, demo_config, write_demo_repository
from service.models.layout import model_versions, valid_model_name


def check_repository(root: Path) -> list[str]:
    return _check_repository(root, max_operator_bytes=DEFAULT_MAX_OPERATOR_BYTES)


GOOD = model_toml(
    max_batch_size=4,
    max_queue_delay_us=100,
    inputs=[bits_input(3, 40, name="spikes")],
    operator={"file": "op.safetensors", "response": "gaussian", "sigma": 2.0},
    outputs=[tensor("out", "FP32")],
)


def write_model(
    root: Path, name: str, text: str = GOOD, *, version: str | None = None, a: int = 5
) -> Path:
    tensors = {
        "x": np.arange(40, dtype=np.float32),
        "c": np.sort(np.random.default_rng(0).uniform(0, 39, (3, a)), 1).astype(np.float32),
    }
    return write_model_folder(root / name / version if version else root / name, text, tensors)


def problems_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config(tomllib.loads(text), "models/foo/config.toml")
    return err.value.problems


def test_named_responses_and_their_parameters() -> None:
    base = GOOD.replace('response = "gaussian"\nsigma = 2.0', "{}")
    for body, params in [
        ('response = "gaussian"\nsigma = 2.0\nsupport = 3', {"sigma": 2.0}),
        ('response = "lorentzian"\ngamma = 1.5', {"gamma": 1.5}),
        ('response = "boxcar"\nhalf_width = 4', {"half_width": 4.0}),
        ('response = "triangle"\nhalf_width = 4', {"half_width": 4.0}),
        ('response = "tabulated"', {}),
        ('response = "tabulated"\non_the_fly = true\ncenter = "peak"', {}),
    ]:
        op = parse_config(tomllib.loads(base.format(body)), "x").operator
        assert op is not None
        assert op.parameters == params
    with pytest.raises(ConfigError, match="'boxcar' takes no support"):
        parse_config(
            tomllib.loads(base.format('response = "boxcar"\nhalf_width = 4\nsupport = 2')), "x"
        )


def test_good_config_and_defaults() -> None:
    cfg = parse_config(tomllib.loads(GOOD), "x")
    assert cfg.max_queue_size == 128
    assert cfg.device == "auto"
    assert cfg.inputs[0].bitorder == "big"
    assert cfg.inputs[0].packed_shape == [3, 5]
    assert cfg.operator is not None
    assert cfg.operator.dtype == "float32"
    assert cfg.model is None


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (("shape = [3, 40]", "shape = [3, 0]"), "inputs[0].shape: dimension 1 is 0; every"),
        (("shape = [3, 40]", "shape = []"), "inputs[0].shape: "),
        (("shape = [3, 40]", 'shape = "big"'), "inputs[0].shape: Input should be a valid list"),
        (('datatype = "BOOL"', 'datatype = "FP32"'), 'inputs[0]: packing = "bits" needs'),
        (('datatype = "BOOL"', 'datatype = "STRING"'), "inputs[0].datatype: Input should be"),
        (('packing = "bits"', 'packing = "bytes"'), "inputs[0].packing: "),
        (('packing = "bits"', 'packing = "bits"\nbitorder = "middle"'), "inputs[0].bitorder: "),
        (('packing = "bits"', 'packing = "bits"\ncolour = 1'), "inputs[0].colour: Extra inputs"),
        (("max_batch_size = 4", "max_batch_size = -1"), "max_batch_size: Input should be greater"),
        (("max_batch_size = 4", "max_batch_size = 4\ndevice = 'gpu'"), "device: 'gpu' is not"),
        (("max_batch_size = 4", "max_batch_size = 4\nbatch = 2"), "batch: Extra inputs"),
        (("sigma = 2.0", "sigma = -2.0"), "operator.sigma: Input should be greater than 0"),
        (("sigma = 2.0", ""), "operator: response = 'gaussian' needs exactly one of sigma"),
        (
            ("sigma = 2.0", "sigma = 2.0\nhalf_width = 3"),
            "operator: response = 'gaussian' takes no half_width",
        ),
        (
            # the lorentzian has no standard deviation: no sigma
            ('response = "gaussian"', 'response = "lorentzian"'),
            "operator: response = 'lorentzian' takes no sigma",
        ),
        (
            ('response = "gaussian"\nsigma = 2.0', 'response = "tabulated"\nsigma = 2.0'),
            "operator: response = 'tabulated' takes no sigma",
        ),
        (('response = "gaussian"', 'response = "cauchy"'), "operator.response: Input should"),
        (("sigma = 2.0", 'sigma = 2.0\ncenter = "mean"'), "operator.center: Input should be"),
        (("sigma = 2.0", 'sigma = 2.0\nborder = "reflect"'), "operator.border: Input should"),
        (('file = "op.safetensors"', 'file = "../op.safetensors"'), "operator.file: must be"),
        (('file = "op.safetensors"', 'file = "/etc/passwd"'), "operator.file: must be"),
        (('name = "out"', 'name = "spikes"'), "(top level): tensor names must be unique"),
        (('datatype = "FP32"', 'datatype = "BOOL"'), "outputs[0].datatype: Input should"),
    ],
)
def test_errors_name_file_and_key(edit: tuple[str, str], expected: str) -> None:
    old, new = edit
    assert old in GOOD
    problems = problems_of(GOOD.replace(old, new, 1))
    assert all(p.startswith("models/foo/config.toml: ") for p in problems), problems
    assert any(expected in p for p in problems), problems


def test_structural_errors() -> None:
    no_op = GOOD.split("[operator]")[0] + '[[outputs]]\nname = "out"\ndatatype = "FP32"\n'
    needle = "needs an [operator], a [model], both, or an [index]"
    assert any(needle in p for p in problems_of(no_op))
    model = GOOD + '\n[model]\nfile = "m.pkl"\n'
    assert any("model.file: must end in one of" in p for p in problems_of(model))
    two_out = GOOD + '\n[[outputs]]\nname = "o2"\ndatatype = "FP32"\n'
    assert any("exactly one output" in p for p in problems_of(two_out))
    rank3 = GOOD.replace("shape = [3, 40]", "shape = [2, 3, 40]")
    assert any("inputs[0].shape is [2, 3, 40]" in p for p in problems_of(rank3))
    two_in = GOOD.replace(
        "[operator]", '[[inputs]]\nname = "b"\ndatatype = "FP32"\nshape = [1]\n\n[operator]'
    )
    # Several inputs need a model to take them (the operator applies to one).
    assert any("without a [model] there is exactly one input" in p for p in problems_of(two_in))
    two_in_model = two_in.replace("[[outputs]]", '[model]\nfile = "m.pt"\n\n[[outputs]]', 1)
    assert parse_config(tomllib.loads(two_in_model), "m").operator_input == 0
    named = two_in_model.replace("response = ", 'input = "nope"\nresponse = ', 1)
    wrong = "operator.input 'nope' is not one of ['spikes', 'b']"
    assert any(wrong in p for p in problems_of(named))
    rank1 = named.replace('input = "nope"', 'input = "b"')
    assert any("inputs[1].shape is [1]" in p for p in problems_of(rank1))


def test_load_config_reports_toml_and_io_errors(tmp_path: Path) -> None:
    bad = tmp_path / "config.toml"
    bad.write_text("max_batch_size = = 3\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad, "models/m/config.toml")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("demo", True),
        ("a.b-c_1", True),
        ("..", False),
        (".hidden", False),
        ("a/b", False),
        ("a\\b", False),
        ("a%2Fb", False),
        ("a\x00b", False),
        ("", False),
        ("x" * 129, False),
    ],
)
def test_model_names(name: str, ok: bool) -> None:
    assert valid_model_name(name) is ok


def test_check_repository_good_and_versions(tmp_path: Path) -> None:
    write_model(tmp_path, "plain")
    write_model(tmp_path, "multi", version="1")
    write_model(tmp_path, "multi", version="10")
    write_model(tmp_path, "multi", version="2")
    (tmp_path / ".git").mkdir()  # hidden entries are not models
    assert check_repository(tmp_path) == []
    assert list(model_versions(tmp_path, "plain")) == ["1"]
    assert list(model_versions(tmp_path, "multi")) == ["1", "2", "10"]


def test_check_repository_reports_every_problem(tmp_path: Path) -> None:
    write_model(tmp_path, "good")
    write_model(tmp_path, "badcfg", GOOD.replace("sigma = 2.0", "sigma = 0"))
    f = write_model(tmp_path, "nofile")
    (f / "op.safetensors").unlink()
    write_model(tmp_path, "shape", GOOD.replace("[3, 40]", "[4, 40]"))
    write_model(tmp_path, "both")
    write_model(tmp_path, "both", version="1")
    (tmp_path / "empty").mkdir()
    write_model(tmp_path, "missingver", version="1")
    (tmp_path / "missingver" / "2").mkdir()
    tab = write_model(
        tmp_path,
        "tab",
        GOOD.replace('response = "gaussian"\nsigma = 2.0', 'response = "tabulated"'),
    )
    assert tab.exists()
    problems = check_repository(tmp_path)
    text = "\n".join(problems)
    root = tmp_path.name
    assert f"{root}/badcfg/config.toml: operator.sigma: Input should be greater than 0" in text
    assert f"{root}/nofile/config.toml: operator.file: file 'op.safetensors' not found" in text
    assert f"{root}/shape/config.toml: operator.file: c has shape [3, 5]" in text
    assert f"{root}/both: has both config.toml and version folders ['1']" in text
    assert f"{root}/empty: no config.toml and no numbered version folder" in text
    assert f"{root}/missingver/2/config.toml: missing" in text
    assert (
        f"{root}/tab/config.toml: operator.file: op.safetensors has no tensor 'response_x'" in text
    )
    assert not any("/good" in p for p in problems)
    assert len(problems) == 8, problems  # tab misses response_x and response_y


def test_output_shape_must_match_operator(tmp_path: Path) -> None:
    write_model(tmp_path, "m", GOOD + "shape = [3, 6]\n")
    assert check_repository(tmp_path) == [
        f"{tmp_path.name}/m/config.toml: outputs[0].shape: [3, 6], but the operator gives [3, 5]"
    ]


def test_files_cannot_escape_the_model(tmp_path: Path) -> None:
    write_model(tmp_path / "outside", "m")
    folder = write_model(tmp_path / "repo", "m")
    (folder / "op.safetensors").unlink()
    os.symlink(tmp_path / "outside" / "m" / "op.safetensors", folder / "op.safetensors")
    (tmp_path / "repo" / "link").symlink_to(tmp_path / "outside" / "m")
    problems = check_repository(tmp_path / "repo")
    assert (
        "repo/m/config.toml: operator.file: 'op.safetensors' resolves outside the model" in problems
    )
    assert "repo/link: resolves outside the repository" in problems
    for bad in ("..", "../outside", "a/b", ".hidden"):
        with pytest.raises(ConfigError):
            model_versions(tmp_path / "repo", bad)


def test_check_repository_on_non_repositories(tmp_path: Path) -> None:
    assert check_repository(tmp_path / "nope") == [f"{tmp_path / 'nope'}: not a directory"]
    assert check_repository(tmp_path) == [f"{tmp_path}: no model folders"]


def test_demo_repository_is_valid_and_matches_builtin(tmp_path: Path) -> None:
    folder = write_demo_repository(tmp_path)
    assert folder == tmp_path / "demo"
    assert check_repository(tmp_path) == []
    on_disk = load_config(folder / "1" / "config.toml")
    assert on_disk == demo_config()
    assert on_disk.inputs[0].packed_shape == [20, 6250]
    assert "sigma = 125.0" in DEMO_CONFIG_TOML
    with pytest.raises(FileExistsError):
        write_demo_repository(tmp_path)


def test_priority_levels_as_in_triton() -> None:
    text = GOOD.replace(
        "max_queue_delay_us = 100",
        "max_queue_delay_us = 100\npriority_levels = 3\ndefault_priority_level = 2",
    )
    text += "\n[priority_queue_policy.1]\nmax_queue_size = 5\n"
    cfg = parse_config(tomllib.loads(text), "x")
    assert (cfg.priority_levels, cfg.default_priority_level) == (3, 2)
    assert cfg.priority_queue_policy[1].max_queue_size == 5
    assert parse_config(tomllib.loads(GOOD), "x").priority_levels == 0
    for settings, expected in [
        ("priority_levels = 2", "default_priority_level must be in [1, 2] (priority_levels)"),
        ("priority_levels = 2\ndefault_priority_level = 3", "must be in [1, 2]"),
        ("default_priority_level = 1", "need priority_levels > 0"),
        (
            "priority_levels = 2\ndefault_priority_level = 1\n[priority_queue_policy.3]\n"
            "max_queue_size = 1",
            "priority_queue_policy levels must be in [1, 2] (priority_levels), got [3]",
        ),
        ("priority_levels = 101", "priority_levels: Input should be less than or equal to 100"),
    ]:
        head, _, table = settings.partition("\n[")
        text = GOOD.replace("max_queue_delay_us = 100", f"max_queue_delay_us = 100\n{head}")
        text += f"\n[{table}\n" if table else ""
        assert any(expected in p for p in problems_of(text)), (settings, problems_of(text))
