"""Loading reward functions: by path, built-in names, entry points; every error is clear."""

import importlib.metadata

import pytest

from miles_k3.rewards import RewardConfig, known_names, load_plugin
from miles_k3.rewards.builtin import exact_match
from tests.rewards.plugins import good

P = "tests.rewards.plugins"


def load(fn: str):
    return load_plugin(RewardConfig(fn=fn))


def test_load_by_path_and_dotted_attribute():
    assert load(f"{P}.good:length_reward").fn is good.length_reward
    plugin = load(f"{P}.good:Scorers.by_label")
    assert plugin.fn is good.Scorers.by_label and plugin.name == f"{P}.good:Scorers.by_label"


@pytest.mark.parametrize("name", ["exact_match", "math_final_answer", "arithmetic"])
def test_builtins_load_by_name(name):
    plugin = load(name)
    assert not plugin.batched and not plugin.is_async and plugin.timeout_s == 30.0


def test_remote_builtin_is_batched_async_with_its_own_deadline():
    plugin = load_plugin(
        RewardConfig(
            fn="remote", url="http://127.0.0.1:9/score", timeout_s=2.0, retries=2, backoff_s=0.5, backoff_max_s=0.75
        )
    )
    assert plugin.batched and plugin.is_async
    assert plugin.timeout_s == pytest.approx(3 * 2.0 + 0.5 + 0.75 + 1.0)


@pytest.mark.parametrize("ref", ["a:b:c", ":fn", "module:", "module:1fn", "my module:fn", "mod:fn()", "mod.:fn"])
def test_malformed_reference(ref):
    with pytest.raises(ValueError, match="malformed: expected 'module.path:function'") as info:
        load(ref)
    assert repr(ref) in str(info.value)


def test_module_not_found():
    with pytest.raises(ValueError, match=f"module '{P}.nope' not found"):
        load(f"{P}.nope:fn")
    with pytest.raises(ValueError, match="module 'no_such_top_level.mod' not found"):
        load("no_such_top_level.mod:fn")


def test_module_with_a_missing_dependency_says_so():
    message = "importing .*broken_dependency' failed: No module named 'miles_k3_no_such_dependency'"
    with pytest.raises(ValueError, match=message):
        load(f"{P}.broken_dependency:reward")


def test_module_that_raises_on_import():
    with pytest.raises(ValueError, match="raised RuntimeError: plugin module is broken") as info:
        load(f"{P}.raises_on_import:reward")
    assert isinstance(info.value.__cause__, RuntimeError)


def test_missing_attribute():
    with pytest.raises(ValueError, match=f"module '{P}.good' has no attribute 'nope'"):
        load(f"{P}.good:nope")
    with pytest.raises(ValueError, match="has no attribute 'Scorers.nope'"):
        load(f"{P}.good:Scorers.nope")


def test_not_callable():
    with pytest.raises(ValueError, match="is not callable \\(it is a int\\)"):
        load(f"{P}.bad:NOT_CALLABLE")


@pytest.mark.parametrize("fn", ["two_args", "no_args", "needs_keyword"])
def test_wrong_signature(fn):
    with pytest.raises(ValueError, match="must accept exactly one positional argument"):
        load(f"{P}.bad:{fn}")


def test_generator_is_rejected():
    with pytest.raises(ValueError, match="is a generator"):
        load(f"{P}.bad:generator")


# --- entry points -------------------------------------------------------------------------------


def fake_entry_points(monkeypatch, *pairs):
    eps = [importlib.metadata.EntryPoint(name, value, "miles_k3.rewards") for name, value in pairs]
    eps.append(importlib.metadata.EntryPoint("elsewhere", f"{P}.good:length_reward", "other.group"))

    def entry_points(*, group=None):
        return [ep for ep in eps if group is None or ep.group == group]

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_entry_point_by_name(monkeypatch):
    fake_entry_points(monkeypatch, ("my_reward", f"{P}.good:async_batched_length_reward"))
    plugin = load("my_reward")
    assert plugin.fn is good.async_batched_length_reward and plugin.batched and plugin.is_async
    assert "my_reward" in known_names() and "elsewhere" not in known_names()


def test_unknown_name_lists_known_names(monkeypatch):
    fake_entry_points(monkeypatch, ("my_reward", f"{P}.good:length_reward"))
    with pytest.raises(ValueError) as info:
        load("nope")
    text = str(info.value)
    assert "unknown reward function 'nope'" in text and "'miles_k3.rewards' entry-point group" in text
    assert "known names: arithmetic, exact_match, math_final_answer, remote, squares, my_reward" in text


def test_unknown_dotted_name_suggests_the_colon_form(monkeypatch):
    fake_entry_points(monkeypatch)
    with pytest.raises(ValueError, match="did you mean 'my_pkg.rewards:score'"):
        load("my_pkg.rewards.score")


def test_ambiguous_entry_point(monkeypatch):
    fake_entry_points(
        monkeypatch,
        ("dup", f"{P}.good:length_reward"),
        ("dup", f"{P}.good:bool_reward"),
        ("same", f"{P}.good:length_reward"),
        ("same", f"{P}.good:length_reward"),
    )
    with pytest.raises(ValueError, match="'dup' is ambiguous.*good:length_reward.*good:bool_reward"):
        load("dup")
    assert load("same").fn is good.length_reward  # one package seen twice is not ambiguous


def test_entry_point_that_fails_to_load(monkeypatch):
    fake_entry_points(monkeypatch, ("broken", f"{P}.broken_dependency:reward"), ("absent", f"{P}.good:nope"))
    with pytest.raises(ValueError, match="'broken': entry point .* failed to load: ModuleNotFoundError"):
        load("broken")
    with pytest.raises(ValueError, match="'absent': entry point .* failed to load: AttributeError"):
        load("absent")


def test_entry_point_to_a_non_callable(monkeypatch):
    fake_entry_points(monkeypatch, ("three", f"{P}.bad:NOT_CALLABLE"))
    with pytest.raises(ValueError, match="'three' .* is not callable"):
        load("three")


def test_builtin_names_are_reserved(monkeypatch):
    fake_entry_points(monkeypatch, ("exact_match", f"{P}.good:length_reward"))
    assert load("exact_match").fn is exact_match
