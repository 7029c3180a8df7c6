"""Game options written as text (--env-opt KEY=VALUE in both command lines) are typed by the game."""

import pytest

import baselines
import envs
import msgrpo
import support


@pytest.mark.parametrize("text, value", [("False", False), ("false", False), ("off", False), ("no", False),
                                         ("0", False), ("True", True), ("on", True), ("YES", True), ("1", True)])
def test_booleans_are_read_by_a_table(text, value):
    assert envs.option_from_text("frozen_lake", "slippery", text) is value
    assert envs.option_from_text("snake", "opponent", text) is value


def test_numbers_and_maps_are_typed_by_the_option():
    assert envs.options_from_text("frozen_lake", [("size", "6"), ("max_steps", "30"), ("hole_penalty", "-1")]) == \
        {"size": 6, "max_steps": 30, "hole_penalty": -1.0}
    assert envs.option_from_text("frozen_lake", "map", "classic") == "classic"
    assert envs.option_from_text("frozen_lake", "map", "random") is None
    rows = envs.option_from_text("frozen_lake", "map", "SFF,FHF,FFG")
    assert rows == ["SFF", "FHF", "FFG"] and envs.make("frozen_lake", map=rows).fixed_map == rows


@pytest.mark.parametrize("env, key, text, named", [
    ("frozen_lake", "slippery", "maybe", "true, on, yes, 1, false, off, no, 0"), ("frozen_lake", "size", "abc", "int"),
    ("frozen_lake", "size", "4.0", "int"), ("frozen_lake", "hole_penalty", "nan", "finite"),
    ("frozen_lake", "colour", "red", "valid options"), ("snake", "slippery", "true", "valid options")])
def test_text_that_is_no_value_of_the_option_is_rejected_by_name(env, key, text, named):
    with pytest.raises(ValueError) as error:
        envs.option_from_text(env, key, text)
    assert key in str(error.value) and named in str(error.value)


def test_a_string_is_never_taken_for_a_boolean_or_a_number():
    with pytest.raises(ValueError, match="slippery"):
        envs.make("frozen_lake", slippery="False")
    with pytest.raises(ValueError, match="invalid_penalty"):
        envs.make("snake", invalid_penalty="-0.1")


def test_slippery_false_means_firm_ice_in_both_command_lines():
    args = msgrpo.build_parser().parse_args(["--env-opt", "slippery=False", "--run-dir", "unused-run"])
    cfg, _ = support.config_from_args(args, msgrpo.Config, msgrpo.resolve_defaults, msgrpo.env_options)
    assert cfg.env_options == {"slippery": False}
    result = baselines.main(["--agent", "random", "--episodes", "2", "--env-opt", "slippery=off"])
    assert result["env_options"]["slippery"] is False


def test_a_goal_beyond_max_steps_is_warned_about():
    assert "38 moves" in envs.pointless_options_warning(envs.make("frozen_lake", size=20))
    assert envs.pointless_options_warning(envs.make("frozen_lake", size=4)) == ""
    assert envs.pointless_options_warning(envs.make("frozen_lake", map="classic", max_steps=5)) != ""
    assert envs.pointless_options_warning(envs.make("snake")) == ""


@pytest.mark.parametrize("env, size, allowed", [
    ("snake", 3000, "from 5 to 32"), ("snake", 33, "from 5 to 32"),
    ("snake_poison_apple", 40, "from 5 to 32"), ("frozen_lake", 33, "from 2 to 32")])
def test_a_board_too_large_to_play_is_refused_with_the_range(env, size, allowed):
    """A board of side n is n^2 characters of prompt per step: a 3000 x 3000 Snake board took 14 s
    per reset and an 18-million-character prompt."""
    with pytest.raises(ValueError, match=f"option size must be an int {allowed}, got {size}"):
        envs.make(env, size=size)
    assert envs.make(env, size=32).size == 32
