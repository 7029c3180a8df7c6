"""The parser: the text-to-action half of the game. Tricky and malformed responses."""

import pytest

import envs

LAKE = envs.FROZEN_LAKE_ACTIONS  # left, down, right, up
LEFT, DOWN, RIGHT, UP = range(4)

CASES = [
    # (response, expected action index or None)
    ("<action>right</action>", RIGHT),
    ("<action>RIGHT</action>", RIGHT),  # mixed case
    ("<Action>Up</ACTION>", UP),  # mixed-case tags
    ("<action>  down \n</action>", DOWN),  # whitespace
    ("<action> Move RIGHT. </action>", RIGHT),  # extra words and punctuation
    ("<action>left!</action>", LEFT),  # trailing punctuation
    ("<action>left</action> <action>up</action>", UP),  # two tags: the last one wins
    ("I think up is best. <action>down</action>", DOWN),  # the tag beats words outside it
    ("<action>left or right</action>", None),  # two different actions in one tag
    ("<action>right, right</action>", RIGHT),  # the same action twice is still one action
    ("<action></action>", None),  # empty tag
    ("<action>jump</action>", None),  # not an action
    ("<action>2</action>", None),  # numbers are not action words
    ("<action>leftover</action>", None),  # whole words only
    ("<action>upward</action>", None),
    ("<action>ríght</action>", None),  # non-ASCII look-alike
    ("<action>→ right ←</action>", RIGHT),  # non-ASCII symbols around a real word
    ("<action>ｒｉｇｈｔ</action>", None),  # full-width letters are not the word
    ("<action>right", RIGHT),  # unclosed: cut off at the token limit, or a pre-filled tag
    ("<action>down and then some more text that got cut", DOWN),
    ("<action>right\nbecause left is a hole", RIGHT),  # unclosed: only its first line counts
    ("<action>\n up \n", UP),
    ("right</action>", RIGHT),  # the opening tag was pre-filled in the prompt
    ("<think>go left</think>", None),  # the move is only thought about
    ("<think><action>left</action></think>", None),
    ("<think>left is a hole</think><action>down</action>", DOWN),
    ("<think>unclosed thinking about right", None),
    ("reasoning that the chat template started</think><action>up</action>", UP),
    ("Right.", RIGHT),  # a lone action word as the whole response
    (" up\n", UP),
    ("**Down**", DOWN),
    ("I go right", None),  # a sentence without a tag is not a lone word
    ("1. right", None),
    ("", None),
    ("   ", None),
    (None, None),
    ("<action>right</action><action>", RIGHT),  # a complete tag beats a trailing empty one
]


@pytest.mark.parametrize("response, expected", CASES)
def test_parse_action(response, expected):
    assert envs.parse_action(response, LAKE) == expected


def test_env_parse_action_uses_its_own_action_list():
    snake = envs.make("snake")
    lake = envs.make("frozen_lake")
    assert snake.actions[snake.parse_action("<action>up</action>")] == "up"
    assert lake.actions[lake.parse_action("<action>up</action>")] == "up"
    assert snake.parse_action("<action>up</action>") != lake.parse_action("<action>up</action>")


def test_there_are_at_least_twenty_tricky_cases():
    assert len(CASES) >= 20
