"""One settings object (verispec.options.SpeculationSettings): what build_engine, the API's entry points,
the drafter factories, the CLI and the server take, with its defaults in one place."""

import inspect

import pytest

from conftest import loaded, tiny_llama
from verispec import api, errors
from verispec.api import build_engine, generate, generate_batch, stream
from verispec.drafters import METHODS
from verispec.options import (LOCAL_OPTIONS, WIRE_OPTIONS, SpeculationChoices, SpeculationSettings,
                              SuffixSettings)

# a valid value, other than the default, for every option the model declares
SAMPLES = {"method": "ngram", "draft_length": 3, "adaptive": True, "max_draft_length": 8, "ngram_max": 4,
           "ngram_min": 2, "suffix_cache": "private", "suffix_alpha": 2.0, "suffix_min_prob": 0.25, "suffix_depth": 12,
           "lookahead_window": 3, "lookahead_ngram": 4, "lookahead_candidates": 3, "tree": "dynamic", "tree_budget": 8,
           "tree_topk": 2, "tree_depth": 3, "verify_cost": {1: 1.0, 2: 1.5}, "backend": "hf", "exact": False,
           "compile": True, "weights": "bf16", "draft": "some-draft-model", "head": "/some/head/folder"}


@pytest.fixture(scope="module")
def tiny():
    return loaded(tiny_llama())


def test_the_samples_cover_every_option():
    assert set(SAMPLES) == set(SpeculationSettings.options())
    defaults = SpeculationSettings().flat()
    assert all(SAMPLES[k] != defaults[k] for k in SAMPLES)


def test_flat_names_round_trip_through_the_sub_objects():
    s = SpeculationSettings.of(**SAMPLES)
    assert s.flat() == SAMPLES
    assert s.suffix == SuffixSettings(cache="private", alpha=2.0, min_prob=0.25, depth=12)
    assert (s.ngram.max_n, s.lookahead.window, s.tree.shape, s.backend.name, s.models.head) == (
        4, 3, "dynamic", "hf", "/some/head/folder")
    assert s.replace(suffix_alpha=3.0).suffix.alpha == 3.0 and s.replace(suffix_alpha=3.0).ngram.max_n == 4
    assert SpeculationSettings.of().flat() == SpeculationSettings().flat()  # None / nothing given: the defaults


def test_defaults_live_in_the_model_only():
    # build_engine and the drafter factories hold no option defaults of their own
    params = inspect.signature(build_engine).parameters
    assert list(params) == ["target", "method", "settings", "runner", "options"]
    assert params["method"].default is None and params["settings"].default is None
    for name, factory in METHODS.items():
        assert list(inspect.signature(factory).parameters) == ["target", "settings"], name


def test_build_engine_takes_keywords_or_a_settings_object(tiny):
    by_keywords = build_engine(tiny, "ngram", draft_length=3, backend="hf")
    settings = SpeculationSettings.of(method="ngram", draft_length=3, backend="hf")
    by_object = build_engine(tiny, settings=settings)
    assert by_keywords.method == by_object.method == "ngram"
    ids, params = [1, 2, 3, 1, 2, 3, 1], api._params(max_new_tokens=12)
    assert by_keywords.generate(ids, params).token_ids == by_object.generate(ids, params).token_ids
    # keywords override the object's options
    assert build_engine(tiny, "ar", settings=settings).method == "ar"
    with pytest.raises(errors.InvalidParameter, match="settings must be a SpeculationSettings"):
        build_engine(tiny, settings={"method": "ngram"})


def _entry_points(target):
    return {"generate": lambda **kw: generate(target, "1 2 3 1 2 3", **kw),
            "stream": lambda **kw: list(stream(target, "1 2 3 1 2 3", **kw)),
            "generate_batch": lambda **kw: generate_batch(target, ["1 2 3 1 2 3", "4 5 4 5"], **kw)}


@pytest.mark.parametrize("entry", ["generate", "stream", "generate_batch"])
def test_every_entry_point_accepts_every_option(tiny, entry, monkeypatch):
    seen = []
    real = api.build_engine

    def recording(target, settings=None, **kw):
        seen.append(settings)
        return real(target, settings=SpeculationSettings(backend=settings.backend.model_copy(
            update={"compile": False, "weights": None})))

    monkeypatch.setattr(api, "build_engine", recording)
    call = _entry_points(tiny)[entry]
    for name, value in SAMPLES.items():
        seen.clear()
        call(max_new_tokens=2, **{name: value})
        assert seen and all(s.flat()[name] == value for s in seen), name


@pytest.mark.parametrize("entry", ["generate", "stream", "generate_batch"])
def test_head_and_max_draft_length_reach_the_engine(tiny, entry):
    call = _entry_points(tiny)[entry]
    call(method="ngram", adaptive=True, max_draft_length=8, max_new_tokens=6)  # a TypeError in generate() once
    with pytest.raises(errors.HeadMismatch, match="not a head folder"):  # once a TypeError in stream()
        call(method="eagle", head="/no/such/head", max_new_tokens=2)


def test_an_unknown_option_is_the_same_clear_error_everywhere(tiny):
    messages = set()
    for name, call in _entry_points(tiny).items():
        with pytest.raises(errors.InvalidParameter) as e:
            call(max_new_tokens=2, flux_capacitor=1)
        messages.add(str(e.value))
    assert len(messages) == 1
    (message,) = messages
    assert message.startswith("unknown option 'flux_capacitor'; use one of:") and "\n" not in message
    assert "max_draft_length" in message and "head" in message and "temperature" in message
    with pytest.raises(errors.InvalidParameter, match="unknown option 'flux_capacitor'"):
        build_engine(tiny, flux_capacitor=1)


def test_bad_values_fail_before_the_model_loads():
    for call in (lambda: generate("no-such-model", "hi", draft_length=0),
                 lambda: stream("no-such-model", "hi", draft_length=0),
                 lambda: generate_batch("no-such-model", ["hi"], draft_length=0)):
        with pytest.raises(errors.InvalidParameter, match="draft_length must be >= 1"):
            call()


def test_the_request_form_is_the_settings_without_the_local_options():
    assert set(WIRE_OPTIONS) == set(SpeculationSettings.options()) - set(LOCAL_OPTIONS)
    for name in WIRE_OPTIONS:  # same description and range as the model's field
        assert SpeculationChoices.model_fields[name].description == SpeculationSettings.field_info(name).description
    schema = SpeculationChoices.model_json_schema()["properties"]
    assert schema["suffix_depth"]["anyOf"][0] == {"type": "integer", "minimum": 2, "maximum": 64}


def test_server_config_holds_the_settings():
    from verispec.server import ServerConfig

    config = ServerConfig(method="ngram", draft_length=4)
    assert config.settings.method == "ngram" and config.settings.draft_length == 4 and config.method == "ngram"
    config = ServerConfig(settings=SpeculationSettings.of(method="suffix", suffix_alpha=2.0), adaptive=True)
    assert (config.settings.method, config.settings.suffix.alpha, config.settings.adaptive) == ("suffix", 2.0, True)
    with pytest.raises(errors.InvalidParameter, match="draft_length must be >= 1"):
        ServerConfig(draft_length=0)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_flags_are_the_settings_options(command):
    import typer

    from verispec.cli import app
    from verispec.commands.speculation import NOT_FLAGS

    click = typer.main.get_command(app).commands[command]
    options = {p.name: p for p in click.params}
    for name in SpeculationSettings.options():
        if name in NOT_FLAGS:
            continue
        assert name in options, name
        assert "--" + name.replace("_", "-") in options[name].opts
        default = SpeculationSettings.field_info(name).default
        if default is not None:
            assert f"default: {default}" in options[name].help, name


def test_cli_bench_checks_its_methods_options_before_loading():
    from typer.testing import CliRunner

    from verispec.cli import app

    r = CliRunner().invoke(app, ["bench", "--model", "no-such-model", "--method", "ngram:ngram_max=100"])
    assert r.exit_code == 2 and "ngram_max must be <= 32" in r.output and "Traceback" not in r.output
