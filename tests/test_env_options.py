"""Game options written as text (--env-opt KEY=VALUE in both command lines) are typed by the
game."""

import pytest

import baselines
import envs
import msgrpo
import support


@pytest.mark.parametrize("text, value", [("False", False), ("false", False), ("off", False),
                                         ("no", False), ("0", False), ("True", True), ("on", True),
                                         ("YES", True), ("1", True)])
def test_booleans_are_read_by_a_table(text, value):
    assert envs.option_from_text("frozen_lake", "slippery", text) is value
    assert envs.option_from_text("snake", "opponent", text) is value


def test_numbers_and_maps_are_typed_by_the_option():
    assert (envs.options_from_text("frozen_lake", [("size", "6"), ("max_steps", "30"),
                                                   ("hole_penalty", "-1")])
            == {"size": 6, "max_steps": 30, "hole_penalty": -1.0})
    assert envs.option_from_text("frozen_lake", "map", "classic") == "classic"
    assert envs.option_from_text("frozen_lake", "map", "random") is None
    rows = envs.option_from_text("frozen_lake", "map", "SFF,FHF,FFG")
    assert rows == ["SFF", "FHF", "FFG"] and envs.make("frozen_lake", map=rows).fixed_map == rows


@pytest.mark.parametrize("env, key, text, named", [
    ("frozen_lake", "slippery", "maybe", "true, on, yes, 1, false, off, no, 0"),
    ("frozen_lake", "size", "abc", "int"),
    ("frozen_lake", "size", "4.0", "int"), ("frozen_lake", "hole_penalty", "nan", "finite"),
    ("frozen_lake", "colour", "red", "valid options"),
    ("snake", "slippery", "true", "valid options")])
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
    args = msgrpo.build_parser().parse_args(["--env-opt", "slippery=False",
                                             "--run-dir", "unused-run"])
    cfg, _ = support.config_from_args(args, msgrpo.Config, msgrpo.resolve_defaults,
                                      msgrpo.env_options)
    assert cfg.env_options == {"slippery": False}
    result = baselines.main(["--agent", "random", "--episodes", "2", "--env-opt", "slippery=off"])
    assert result["env_options"]["slippery"] is False


def test_a_goal_beyond_max_steps_is_warned_about():
    assert "38 moves" in envs.pointless_options_warning(envs.make("frozen_lake", size=20))
    assert envs.pointless_options_warning(envs.make("frozen_lake", size=4)) == ""
    assert envs.pointless_options_warning(envs.make("frozen_lake", map="classic",
                                                    max_steps=5)) != ""
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


@pytest.mark.parametrize("env, options, free", [
    ("snake", {"apples": 3_000_000_000}, 97), ("snake", {"size": 5, "apples": 23}, 22),
    ("snake", {"size": 5, "apples": 20, "opponent": True}, 19),
    ("snake_poison_apple", {"size": 5, "apples": 12, "bananas": 11}, 22)])
def test_more_fruit_than_free_cells_is_refused_when_the_game_is_made(env, options, free):
    """Each apple and banana takes a free cell: apples in the billions would keep reset looking
    for cells for hours."""
    with pytest.raises(ValueError) as error:
        envs.make(env, **options)
    message = str(error.value)
    assert "apples" in message and f"at most {free}" in message and "\n" not in message


def test_a_board_may_be_filled_with_fruit_to_its_last_free_cell():
    _, info = envs.make("snake_poison_apple", size=5, apples=12, bananas=10).reset(seed=0)
    assert len(info["apples"]) == 12 and len(info["bananas"]) == 10
    _, info = envs.make("snake", size=5, apples=19, opponent=True).reset(seed=0)
    assert len(set(info["apples"]) | set(info["snake"]) | set(info["opponent"])) == 25


def lake_map(rows, cols):
    return ["S" + "F" * (cols - 1)] + ["F" * cols] * (rows - 2) + ["F" * (cols - 1) + "G"]


@pytest.mark.parametrize("rows, cols", [(100, 100), (33, 2), (2, 33)])
def test_a_map_larger_than_the_board_cap_is_refused_as_size_is(rows, cols):
    with pytest.raises(ValueError) as error:
        envs.make("frozen_lake", map=lake_map(rows, cols))
    message = str(error.value)
    assert f"{rows}x{cols}" in message and "at most 32" in message and "\n" not in message
    assert envs.make("frozen_lake", map=lake_map(32, 32)).fixed_map == lake_map(32, 32)


def test_varied_rules_is_a_snake_option_on_the_command_line():
    assert envs.options_from_text("snake", [("varied_rules", "true")]) == {"varied_rules": True}
    assert envs.option_from_text("snake", "varied_rules", "off") is False
    with pytest.raises(ValueError, match="varied_rules"):
        envs.option_from_text("snake", "varied_rules", "sometimes")
    with pytest.raises(ValueError, match="has no option 'varied_rules'"):  # its rules stay fixed
        envs.option_from_text("snake_poison_apple", "varied_rules", "true")
    args = msgrpo.build_parser().parse_args(["--env", "snake", "--env-opt", "varied_rules=true",
                                             "--run-dir", "unused-run"])
    cfg, _ = support.config_from_args(args, msgrpo.Config, msgrpo.resolve_defaults,
                                      msgrpo.env_options)
    assert cfg.env_options["varied_rules"] is True
    training_game = envs.make(cfg.env, **msgrpo.training_env_options(cfg))
    rules = set()
    for seed in range(20):  # the rules are drawn when a game starts
        training_game.reset(seed=seed)
        rules.add(training_game.rules)
    assert len(rules) > 1 and all("Eating a" in text for text in rules)
