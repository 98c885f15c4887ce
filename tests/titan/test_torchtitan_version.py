"""The adapter's TorchTitan: 0.2.2 is taken, another release is refused by name at the
adapter's import (not with the first module it lacks), and the engine imports without it."""

import os
import subprocess
import sys

import pytest

from torchtitan_dmuon.titan.version import (
    SUPPORTED_TORCHTITAN,
    UnsupportedTorchTitan,
    check_torchtitan,
)


def test_the_installed_torchtitan_is_the_supported_one():
    assert check_torchtitan() == SUPPORTED_TORCHTITAN == "0.2.2"
    assert check_torchtitan("0.2.2+git1234") == "0.2.2+git1234"


@pytest.mark.parametrize("version", ["0.3.0", "0.2.1", "0.4.0.dev20261201"])
def test_another_release_is_refused_with_what_to_do(version):
    with pytest.raises(UnsupportedTorchTitan) as error:
        check_torchtitan(version)
    message = str(error.value)
    assert f"TorchTitan {version}" in message and "0.2.2" in message
    assert "dedicate_params" in message and "torchtitan==0.2.2" in message
    assert isinstance(error.value, ImportError)


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


def test_torchtitan_0_3_is_refused_at_the_adapter_import_and_the_engine_still_imports(tmp_path):
    _fake_torchtitan(tmp_path, "0.3.0")
    engine = _python("import torchtitan_dmuon, torchtitan; print(torchtitan.__file__)", tmp_path)
    assert engine.returncode == 0, engine.stderr
    assert engine.stdout.strip().startswith(str(tmp_path))  # the fake one was the one seen
    adapter = _python("import torchtitan_dmuon.titan", tmp_path)
    assert adapter.returncode == 1
    assert "UnsupportedTorchTitan" in adapter.stderr and "TorchTitan 0.3.0" in adapter.stderr
    assert "ModuleNotFoundError" not in adapter.stderr
