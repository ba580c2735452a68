"""`serve`'s settings: a type per layer composed into ServeSettings, each default written once, the
flags generated from the fields, the worker hand-off whole and the engine process's its part alone."""

import argparse
import dataclasses
import inspect

import pytest

from snac_fast.batching import AsyncStreamBatcher, StreamBatcher
from snac_fast.batching.defaults import LIBRARY_MAX_BATCH, LIBRARY_MAX_WAIT_MS, SERVER_MAX_BATCH, SERVER_MAX_WAIT_MS
from snac_fast.serve.engine.batcher import EngineBatcher
from snac_fast.serve.settings import EngineSettings, HTTPSettings, LMSettings, ServeSettings, add_arguments


def parsed(*argv: str) -> ServeSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return ServeSettings.from_arguments(parser.parse_args(list(argv)))


def test_each_option_belongs_to_one_part_and_its_flag_default_is_the_fields():
    parts = (EngineSettings, LMSettings, HTTPSettings)
    names = [f.name for kind in parts for f in dataclasses.fields(kind)]
    assert len(names) == len(set(names)), "an option in two parts"
    assert parsed() == ServeSettings()  # no flag given: every field's own default
    assert ServeSettings().engine.max_batch == SERVER_MAX_BATCH and ServeSettings().engine.max_wait_ms == SERVER_MAX_WAIT_MS


def test_the_library_batchers_take_their_defaults_from_the_same_place():
    for batcher in (AsyncStreamBatcher, StreamBatcher):
        defaults = inspect.signature(batcher.__init__).parameters
        assert defaults["max_batch"].default == LIBRARY_MAX_BATCH and defaults["max_wait_ms"].default == LIBRARY_MAX_WAIT_MS
    assert inspect.signature(EngineBatcher.__init__).parameters["max_wait_ms"].default == LIBRARY_MAX_WAIT_MS


def test_flags_reach_their_parts_and_the_json_hand_off_is_whole():
    settings = parsed("--max-batch", "8", "--max-wait-ms", "4", "--lm-timeout", "5", "--voice", "leo", "--port", "9000",
                      "--lookahead", "fp16", "--engine-calls", "thread")
    assert (settings.engine.max_batch, settings.engine.max_wait_ms, settings.engine.lookahead) == (8, 4.0, "fp16")
    assert settings.lm.lm_timeout_s == 5 and settings.lm.voice == "leo" and settings.http.port == 9000
    assert ServeSettings.from_json(settings.to_json()) == settings


@pytest.mark.parametrize("argv, calls, loop_in_worker, loop_in_engine_process", [
    ((), "auto", True, False),  # each where it was measured the faster
    (("--engine-calls", "thread"), "thread", False, False),
    (("--engine-calls", "loop"), "loop", True, True),
    (("--engine-thread",), "thread", False, False),  # the earlier flags, kept
    (("--engine-event-loop",), "loop", True, True),
])
def test_one_flag_says_who_runs_the_engine_calls(argv, calls, loop_in_worker, loop_in_engine_process):
    engine = parsed(*argv).engine
    assert engine.engine_calls == calls
    assert engine.calls_on_loop(engine_process=False) == loop_in_worker
    assert engine.calls_on_loop(engine_process=True) == loop_in_engine_process


def test_options_named_alone_go_to_their_part_and_a_wrong_name_is_refused():
    settings = ServeSettings.of(max_streams=64, lm_url="http://127.0.0.1:8000/v1", workers=2)
    assert settings.engine.max_streams == 64 and settings.lm.lm_url.endswith("/v1") and settings.http.workers == 2
    with pytest.raises(TypeError, match="no option 'max_stream'"):
        ServeSettings.of(max_stream=64)


@pytest.mark.parametrize("options, message", [
    ({"max_batch": 0}, "--max-batch must be >= 1"), ({"idle_timeout_s": 0}, "--idle-timeout must be > 0"),
    ({"lm_timeout_s": -1}, "--lm-timeout must be > 0"), ({"segment_chars": 0}, "--segment-chars must be >= 1"),
    ({"port": 0}, "--port must be 1-65535"), ({"engine_calls": "often"}, "--engine-calls must be one of"),
    ({"ws_idle_timeout_s": 0}, "--ws-idle-timeout must be > 0"),
    ({"voice": "bob", "lm_preset": "orpheus"}, "--voice 'bob' is not one of the orpheus preset"),
])
def test_each_part_names_its_bad_value(options, message):
    with pytest.raises(ValueError, match=message):
        ServeSettings.of(**options).check()
