"""The compile modes the trainer offers (trainer/compile_modes.py): the keywords each gives torch.compile,
and a mode that cannot change once something was compiled with another."""

from __future__ import annotations

import threading

import pytest

from trainer import compile_modes
from trainer.compile_modes import COMPILE_MODES, REFUSED_COMPILE_MODES


@pytest.fixture
def fresh_modes(monkeypatch):
    """The module's process-wide state as at startup, put back afterwards."""
    monkeypatch.setattr(compile_modes, "_mode", "default")
    monkeypatch.setattr(compile_modes, "_used", False)


def test_offered_and_refused_modes_do_not_overlap_and_the_default_is_offered():
    assert "default" in COMPILE_MODES and not set(COMPILE_MODES) & set(REFUSED_COMPILE_MODES)
    assert all("cudagraphs" in mode or mode == "default" for mode in COMPILE_MODES)


@pytest.mark.parametrize("mode", [*REFUSED_COMPILE_MODES, "fast", ""])
def test_a_mode_not_offered_gets_no_keywords(mode):
    with pytest.raises(ValueError, match=f"compile mode '{mode}' is not one of default, "):
        compile_modes.torch_compile_kwargs(mode)


def test_static_full_graphs_in_the_chosen_mode(fresh_modes):
    assert compile_modes.compile_options() == {"dynamic": False, "fullgraph": True}
    compile_modes._used = False
    compile_modes.set_compile_mode("max-autotune-no-cudagraphs")
    assert compile_modes.compile_options() == {
        "dynamic": False,
        "fullgraph": True,
        "mode": "max-autotune-no-cudagraphs",
    }


def test_the_mode_is_fixed_once_something_was_compiled(fresh_modes):
    compile_modes.set_compile_mode("max-autotune-no-cudagraphs")
    compile_modes.set_compile_mode("default")  # nothing compiled yet: free to change
    compile_modes.compile_options()
    compile_modes.set_compile_mode("default")  # the same mode again is fine
    with pytest.raises(RuntimeError, match="already compiled with mode 'default'.*before the first step"):
        compile_modes.set_compile_mode("max-autotune-no-cudagraphs")
    with pytest.raises(ValueError):
        compile_modes.set_compile_mode("reduce-overhead")
    assert compile_modes.compile_options() == {"dynamic": False, "fullgraph": True}


def test_threads_asking_for_options_all_see_one_mode(fresh_modes):
    compile_modes.set_compile_mode("max-autotune-no-cudagraphs")
    seen = []
    threads = [
        threading.Thread(target=lambda: seen.append(compile_modes.compile_options())) for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 8 and all(s["mode"] == "max-autotune-no-cudagraphs" for s in seen)
