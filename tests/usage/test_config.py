"""Hydra composition: every config file composes against its dataclass schema; bad input is a clear error."""

import dataclasses

import pytest
from hydra.errors import HydraException
from omegaconf import OmegaConf

from kvcomp.codecs import CODECS, ModelInfo, build_codec, codec_config
from kvcomp.config import BENCHMARKS, GROUPS, group_file, register_configs, typed
from kvcomp.errors import ConfigError
from tests.helpers import CONF, compose_config

register_configs()


def _options(group):
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_default_is_the_embedded_model_on_cpu():
    cfg = compose_config()
    assert cfg.model.source == "embedded" and cfg.hardware.device == "cpu" and cfg.codec.name == "kivi"
    assert cfg.benchmark.protocols == ["streaming", "simulated"] and cfg.benchmark.chunk_tokens == 32


@pytest.mark.parametrize("group", list(GROUPS) + ["codec"])
def test_every_option_composes_and_matches_its_dataclass(group):
    for option in _options(group):
        node = compose_config(f"{group}={option}")[group]
        schema = (
            CODECS[node.name].config_class if group == "codec"
            else BENCHMARKS[node.name].config_class if group == "benchmark" else GROUPS[group]
        )
        raw = OmegaConf.load(CONF / group / f"{option}.yaml")
        yaml_keys, fields = set(raw) - {"defaults"}, {f.name for f in dataclasses.fields(schema)}
        if any(not str(entry).startswith(("schema", "_self_")) for entry in raw.get("defaults", [])):
            # a preset (e.g. codec/qjl_3bit): a few overrides on top of another option of the group
            assert yaml_keys < fields and set(node) == fields, f"{group}/{option}.yaml vs {schema.__name__}"
        elif group == "codec":  # a codec's base file names its schema; the dataclass holds every default, the name too
            assert not yaml_keys and set(node) == fields, f"{group}/{option}.yaml vs {schema.__name__}"
        else:
            assert yaml_keys == fields, f"{group}/{option}.yaml vs {schema.__name__}"
        parsed = codec_config(node) if group == "codec" else typed(group, node, schema)
        assert isinstance(parsed, schema)


def _codec_files() -> tuple[list[str], dict[str, str]]:
    """conf/codec's base files (``defaults: [schema_<name>, _self_]``) and its presets with the file each
    builds on (``defaults: [<codec file>, _self_]``)."""
    bases, presets = [], {}
    for option in _options("codec"):
        named = [str(e) for e in OmegaConf.load(CONF / "codec" / f"{option}.yaml").get("defaults", [])
                 if not str(e).startswith(("schema", "_self_"))]
        if named:
            presets[option] = named[0]
        else:
            bases.append(option)
    return bases, presets


def test_base_codec_files_hold_only_the_schema():
    """A base file names its schema and nothing else: the codec's name is its dataclass's ``name`` default, which
    ``@register`` also gives the class, so the composed ``codec.name`` is the file's."""
    bases, _ = _codec_files()
    assert sorted(bases) == sorted(CODECS), "every codec has one base file conf/codec/<name>.yaml"
    errors = []
    for option in bases:
        raw = OmegaConf.to_container(OmegaConf.load(CONF / "codec" / f"{option}.yaml"))
        if raw.get("defaults") != [f"schema_{option}", "_self_"]:
            errors.append(f"codec/{option}.yaml: needs defaults: [schema_{option}, _self_]")
        errors += [f"codec/{option}.yaml: {key}: the default belongs in {CODECS[option].config_class.__name__}, "
                   f"not in the YAML" for key in sorted(set(raw) - {"defaults"})]
        if compose_config(f"codec={option}").codec.name != option or CODECS[option].name != option:
            errors.append(f"codec/{option}.yaml does not compose codec.name={option}")
        if group_file(CONF / "codec" / f"{option}.yaml") != {"name": option}:  # what scripts build a codec from
            errors.append(f"group_file(codec/{option}.yaml) does not name {option}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_composed_codec_defaults_are_the_dataclass_defaults(name):
    node = compose_config(f"codec={name}").codec
    composed, defaults = OmegaConf.to_container(node), CODECS[name].config_class()
    built = build_codec({"name": name}, ModelInfo("m", 2, 2, 64)).config  # what a library caller gets
    assert set(composed) == {f.name for f in dataclasses.fields(defaults)}, f"codec/{name}.yaml: fields"
    errors = [f"codec/{name}.yaml: {f.name} composes to {composed[f.name]!r}, {type(defaults).__name__} "
              f"default {getattr(defaults, f.name)!r}, build_codec gives {getattr(built, f.name)!r}"
              for f in dataclasses.fields(defaults)
              if not composed[f.name] == getattr(defaults, f.name) == getattr(built, f.name)]
    assert not errors, "\n".join(errors)


def test_codec_presets_set_only_what_differs_from_their_base():
    _, presets = _codec_files()
    errors = []
    for option, base in presets.items():
        raw, below = OmegaConf.load(CONF / "codec" / f"{option}.yaml"), compose_config(f"codec={base}").codec
        restated = {key for key in set(raw) - {"defaults"} if raw[key] == below[key]}
        errors += [f"codec/{option}.yaml: {key}: {raw[key]!r} restates codec/{base}'s default; remove it"
                   for key in sorted(restated)]
    assert not errors, "\n".join(errors)


def test_hub_models_restate_no_shapes():
    for option in _options("model"):
        keys = set(OmegaConf.load(CONF / "model" / f"{option}.yaml"))
        assert not keys & {"num_layers", "num_heads", "head_dim", "hidden_size"}


def test_unknown_codec_lists_the_choices():
    with pytest.raises(HydraException, match=r"(?s)codec/nope.*Available options.*kivi"):
        compose_config("codec=nope")


def test_unknown_and_mistyped_fields_are_rejected_at_compose_time():
    with pytest.raises(HydraException, match="bitz"):
        compose_config("codec.bitz=2")
    with pytest.raises(HydraException, match="bits"):
        compose_config("codec.bits=two")


def test_bit_width_the_codec_cannot_do():
    cfg = compose_config("codec=kivi", "codec.bits=12")
    with pytest.raises(ConfigError, match="bits=12 is not supported; choose an integer in 1..8"):
        build_codec(cfg.codec, ModelInfo("m", 2, 2, 64))


def test_typed_rejects_wrong_field():
    with pytest.raises(ConfigError, match="hardware config field 'thread'"):
        typed("hardware", {"thread": 2})


def test_every_benchmark_file_names_a_registered_benchmark_and_back():
    """Every ``@register``-ed benchmark name has its ``conf/benchmark/<name>.yaml``, every file names a registered
    benchmark (presets such as ``leaderboard_ruler`` name theirs), and each validates against its config dataclass."""
    files = {path.stem: OmegaConf.load(path) for path in (CONF / "benchmark").glob("*.yaml")}
    assert {config.name for config in files.values()} == set(BENCHMARKS) <= set(files)
    for stem, config in files.items():
        assert stem == config.name or stem.startswith("leaderboard_"), stem  # a preset says whose it is
    for name, benchmark in BENCHMARKS.items():
        assert benchmark.config_class.name in BENCHMARKS  # its dataclass's own name is registered too
        assert typed("benchmark", compose_config(f"benchmark={name}").benchmark, benchmark.config_class).name == name
    for stem in set(files) - set(BENCHMARKS):
        config = compose_config(f"benchmark={stem}").benchmark
        assert typed("benchmark", config, BENCHMARKS[config.name].config_class).name == config.name


@pytest.mark.parametrize("name", sorted(CODECS))
def test_validate_only_raises(name):
    """A codec's state is made by build(); validate() reads the config and sets nothing (calling it again on a
    built codec leaves every attribute as it was)."""
    codec = build_codec({"name": name}, ModelInfo("m", 2, 2, 64))
    before = dict(vars(codec))
    codec.validate()
    assert vars(codec).keys() == before.keys() and all(vars(codec)[k] is v for k, v in before.items())
