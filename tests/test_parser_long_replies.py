"""The parser on replies of any length: a server's reply has no length limit."""

import random
import re

import envs

LAKE = envs.FROZEN_LAKE_ACTIONS  # left, down, right, up
RIGHT = LAKE.index("right")
MEGABYTE = 1 << 20

# The straightforward search for complete tags, quadratic on many unclosed ones: the reference.
COMPLETE_TAG = re.compile(r"<\s*action\s*>(.*?)<\s*/\s*action\s*>", re.IGNORECASE | re.DOTALL)


def test_a_megabyte_of_unclosed_tags_parses():
    assert envs.parse_action("<action>" * (MEGABYTE // 8), LAKE) is None
    assert envs.parse_action("<action>" * (MEGABYTE // 8) + "right", LAKE) == RIGHT
    assert envs.parse_action("<action>" * (MEGABYTE // 8) + "right</action>", LAKE) == RIGHT


def test_a_megabyte_of_other_tag_debris_parses():
    for text in ["<" + " " * MEGABYTE, "< /" * (MEGABYTE // 3), "</action>" * (MEGABYTE // 9),
                 "<think>" * (MEGABYTE // 7), "<action>up</action>" * (MEGABYTE // 19)]:
        expected = LAKE.index("up") if text.startswith("<action>up") else None
        assert envs.parse_action(text, LAKE) == expected


def test_tags_pair_up_as_the_regex_search_pairs_them():
    pieces = ["<action>", "</action>", "< Action >", "</ action>", "right", "up", " ", "\n", "<",
              ">", "/"]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        found = COMPLETE_TAG.findall(text)
        complete, after_last_opening = envs.action_tags(text)
        assert complete == (found[-1] if found else None), text
        openings = list(re.finditer(r"<\s*action\s*>", text, re.IGNORECASE))
        assert after_last_opening == (text[openings[-1].end():] if openings else None), text
