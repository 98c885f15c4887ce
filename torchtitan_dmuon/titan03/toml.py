"""A TorchTitan 0.2.2 TOML job, translated onto TorchTitan 0.3's config.

TorchTitan 0.3 reads no TOML; this project's users train from TOML files
(``./run_train.sh --job.config_file X.toml``, the ``[dmuon]`` section). :func:`from_toml`
builds a :class:`~torchtitan_dmuon.titan03.trainer.DMuonTrainer.Config` from such a file:
``[model] name, flavor`` pick the model spec of 0.3's model registry over 0.3's defaults
(the model's own debug config gives its loss, tokenizer and dataloader classes, which a
TOML file cannot name), ``[dmuon]`` is the trainer's
``dmuon`` section, ``[optimizer]`` AdamW's settings of DMuon's container, and every other
key goes where 0.3 keeps it: the same section and name where both versions have them,
the few that moved by the table :data:`MOVED` (``[training] dataset`` is the dataloader's,
``[validation]`` the validator's, ``[profiling]`` the profiler's, ``[activation_checkpoint]
mode`` a choice of class). A key 0.3 does not have is refused, naming it, before anything
runs; ``[job] description`` and ``custom_config_module`` (a label, and the module that adds
``[dmuon]`` to 0.2.2's config) need nothing in 0.3 and are read only.

``run_train.sh`` under ``TORCHTITAN_VERSION=0.3.0`` passes ``--job.config_file`` here as
``--module torchtitan_dmuon.titan03 --config from_toml`` with the file in
``TORCHTITAN_DMUON_CONFIG_FILE`` (a config function takes no argument); flags after it
apply over the file, as in 0.2.2.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os

import tomli
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from torchtitan_dmuon.titan.config import DMuon
from torchtitan_dmuon.titan03.trainer import DMuonTrainer

logger = logging.getLogger(__name__)

__all__ = ["CONFIG_FILE_ENV", "MOVED", "from_toml", "translate"]

CONFIG_FILE_ENV = "TORCHTITAN_DMUON_CONFIG_FILE"
"""The TOML file :func:`from_toml` reads (``run_train.sh`` sets it)."""

MOVED = {
    ("job", "dump_folder"): ("dump_folder",),
    ("model", "hf_assets_path"): ("hf_assets_path",),
    ("training", "dataset"): ("dataloader", "dataset"),
    ("training", "dataset_path"): ("dataloader", "dataset_path"),
    ("validation", "enable"): ("validator", "enable"),
    ("validation", "freq"): ("validator", "freq"),
    ("validation", "steps"): ("validator", "steps"),
    ("validation", "dataset"): ("validator", "dataloader", "dataset"),
    ("validation", "dataset_path"): ("validator", "dataloader", "dataset_path"),
}
"""0.2.2 ``(section, key)`` -> where 0.3 keeps it (attribute path from the trainer config)."""

_READ_ONLY = {("job", "description"), ("job", "custom_config_module")}
_PROFILING = "profiling"  # 0.2.2's section; 0.3's is ``profiler``, with the same keys
_AC_MODES = {"none": None, "selective": SelectiveAC.Config, "full": FullAC.Config}


def _base(model: dict) -> DMuonTrainer.Config:
    """0.3's defaults, with the model spec of ``[model] name, flavor`` and what a TOML job
    cannot name taken from the model's own debug config (its loss, tokenizer and
    dataloader classes), and DMuon."""
    name, flavor = model.get("name"), model.get("flavor")
    if not name or not flavor:
        raise ValueError("[model] name and flavor: a TOML job names its model")
    try:
        package = importlib.import_module(f"torchtitan.models.{name}")
        registry = importlib.import_module(f"torchtitan.models.{name}.config_registry")
    except ImportError:
        raise ValueError(f"[model] name = {name!r}: TorchTitan 0.3 has no such model") from None
    debug = getattr(registry, f"{name}_debugmodel", None)
    if debug is None or not hasattr(package, "model_registry"):
        raise ValueError(f"[model] name = {name!r}: not a TorchTitan 0.3 decoder with a registry")
    try:
        spec = package.model_registry(flavor)
    except KeyError:
        raise ValueError(f"[model] flavor = {flavor!r}: {name} has no such flavor") from None
    own = debug()
    config = DMuonTrainer.Config(
        model_spec=spec,
        loss=own.loss,
        tokenizer=own.tokenizer,
        dataloader=type(own.dataloader)(),
    )
    config.training.disable_cuda_graphs = True  # as with_dmuon sets it
    return config


def _set(config, path: tuple[str, ...], value, where: str) -> None:
    target = config
    for attribute in path[:-1]:
        target = getattr(target, attribute)
    names = {f.name for f in dataclasses.fields(target)}
    if path[-1] not in names:
        raise ValueError(f"{where}: TorchTitan 0.3's config has no {'.'.join(path)}")
    setattr(target, path[-1], value)


def translate(toml: dict) -> DMuonTrainer.Config:
    """The 0.3 config of a parsed 0.2.2 TOML job (see the module's docstring).

    Raises:
        ValueError: a key 0.3 does not have (naming it), ``[optimizer] name`` other than
            ``"DMuon"``, a model or flavor 0.3 does not have.
    """
    toml = {section: dict(keys) for section, keys in toml.items()}
    model = toml.pop("model", {})
    config = _base(model)
    for key, value in model.items():
        if key in ("name", "flavor"):
            continue
        if ("model", key) not in MOVED:
            raise ValueError(f"[model] {key}: TorchTitan 0.3 has no model option {key}")
        _set(config, MOVED["model", key], value, f"[model] {key}")
    optimizer = toml.pop("optimizer", {})
    if optimizer.pop("name", "DMuon") != "DMuon":
        raise ValueError("[optimizer] name: a TOML job on TorchTitan 0.3 trains with DMuon")
    for key, value in optimizer.items():
        _set(config, ("optimizer", key), value, f"[optimizer] {key}")
    dmuon = toml.pop("dmuon", {})
    fields = {f.name for f in dataclasses.fields(DMuon)}
    unknown = sorted(set(dmuon) - fields)
    if unknown:
        raise ValueError(f"[dmuon] {unknown[0]}: DMuon has no such setting")
    config.dmuon = DMuon(**dmuon)
    ac = toml.pop("activation_checkpoint", {})
    if ac:
        mode = ac.pop("mode", "selective")
        if mode not in _AC_MODES or ac:
            key = "mode" if mode not in _AC_MODES else sorted(ac)[0]
            raise ValueError(f"[activation_checkpoint] {key}: 0.3 takes mode none, selective, full")
        config.activation_checkpoint = _AC_MODES[mode] and _AC_MODES[mode]()
    for section, keys in toml.items():
        for key, value in keys.items():
            where = f"[{section}] {key}"
            if (section, key) in _READ_ONLY:
                continue
            if (section, key) in MOVED:
                path = MOVED[section, key]
            else:
                path = ("profiler" if section == _PROFILING else section, key)
                if not any(f.name == path[0] for f in dataclasses.fields(config)):
                    raise ValueError(
                        f"[{section}]: TorchTitan 0.3's config has no section {section}"
                    )
            _set(config, path, value, where)
    if toml.get("job", {}).get("description"):
        logger.info(
            "dmuon: job %r (TOML, translated onto TorchTitan 0.3)", toml["job"]["description"]
        )
    return config


def from_toml() -> DMuonTrainer.Config:
    """The config of the TOML file named by ``TORCHTITAN_DMUON_CONFIG_FILE``
    (``--module torchtitan_dmuon.titan03 --config from_toml``).

    Raises:
        ValueError: the variable is unset, or the file has a key 0.3 does not have.
    """
    path = os.environ.get(CONFIG_FILE_ENV)
    if not path:
        raise ValueError(
            f"--config from_toml reads the TOML file named by {CONFIG_FILE_ENV} "
            "(TORCHTITAN_VERSION=0.3.0 ./run_train.sh --job.config_file X.toml sets it)"
        )
    with open(path, "rb") as f:
        return translate(tomli.load(f))
