"""Each adapter's TorchTitan: 0.2.2's adapter takes 0.2.2, 0.3's 0.3.0; the other's release
is refused naming the adapter that serves it, another release naming what to do, at the
import of the adapter's first module that reads TorchTitan (not with the first module it
lacks); the engine imports without it."""

import os
import subprocess
import sys

import pytest

from torchtitan_dmuon.titan.version import (
    ADAPTERS,
    UnsupportedTorchTitan,
    adapter_for,
    check_torchtitan,
)

TITAN, TITAN03 = "torchtitan_dmuon.titan", "torchtitan_dmuon.titan03"


def test_the_installed_torchtitan_is_the_supported_one():
    assert ADAPTERS == {"0.2.2": TITAN, "0.3.0": TITAN03}
    assert check_torchtitan() == "0.2.2"
    assert check_torchtitan(TITAN, "0.2.2+git1234") == "0.2.2+git1234"
    assert check_torchtitan(TITAN03, "0.3.0") == "0.3.0"
    assert adapter_for("0.3.0+git1") == TITAN03 and adapter_for("0.3.1") is None


@pytest.mark.parametrize(
    "adapter, version, serving", [(TITAN, "0.3.0", TITAN03), (TITAN03, "0.2.2", TITAN)]
)
def test_the_other_adapters_release_is_refused_naming_its_adapter(adapter, version, serving):
    with pytest.raises(UnsupportedTorchTitan) as error:
        check_torchtitan(adapter, version)
    message = str(error.value)
    assert f"TorchTitan {version}, whose adapter is {serving}" in message
    assert isinstance(error.value, ImportError)


@pytest.mark.parametrize("version", ["0.2.1", "0.3.1", "0.4.0.dev20261201"])
def test_another_release_is_refused_with_what_to_do(version):
    with pytest.raises(UnsupportedTorchTitan) as error:
        check_torchtitan(TITAN, version)
    message = str(error.value)
    assert f"TorchTitan {version}, which no adapter" in message and "0.2.2" in message
    assert "dedicate_params" in message and "torchtitan==0.2.2" in message


def _fake_torchtitan(root, version):
    """A TorchTitan distribution of ``version`` with none of 0.2.2's modules (0.3.0 has no
    ``torchtitan.protocols.train_spec``)."""
    (root / "torchtitan").mkdir()
    (root / "torchtitan" / "__init__.py").write_text("")
    info = root / f"torchtitan-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torchtitan\nVersion: {version}\n")


def _python(code, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "module", ["torchtitan_dmuon.titan.train", "torchtitan_dmuon.titan.optimizer"]
)
def test_torchtitan_0_3_is_refused_by_the_0_2_adapter_and_the_engine_still_imports(
    module, tmp_path
):
    _fake_torchtitan(tmp_path, "0.3.0")
    engine = _python("import torchtitan_dmuon, torchtitan; print(torchtitan.__file__)", tmp_path)
    assert engine.returncode == 0, engine.stderr
    assert engine.stdout.strip().startswith(str(tmp_path))  # the fake one was the one seen
    # The package itself, and its TorchTitan-free modules, import: the 0.3 adapter uses them.
    shared = _python(
        "import torchtitan_dmuon.titan.config, torchtitan_dmuon.titan.patches", tmp_path
    )
    assert shared.returncode == 0, shared.stderr
    adapter = _python(f"import {module}", tmp_path)
    assert adapter.returncode == 1
    assert "UnsupportedTorchTitan" in adapter.stderr and "TorchTitan 0.3.0" in adapter.stderr
    assert "torchtitan_dmuon.titan03" in adapter.stderr
    assert "ModuleNotFoundError" not in adapter.stderr
