"""Long text cut into segments for the LM (snac_fast.serve.lm.segments): at sentence ends, each at most
the budget, nothing lost."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snac_fast.serve.lm.segments import split_text


def test_sentences_are_packed_whole_up_to_the_budget():
    text = "Hello there. How are you today? I am fine!  Thanks for asking. Bye."
    assert split_text(text, 1000) == [text.replace("  ", " ")]
    assert split_text(text, 32) == ["Hello there. How are you today?", "I am fine! Thanks for asking.", "Bye."]
    assert split_text("“Quoted.” Next one… 句子。下一句！", 12) == ["“Quoted.”", "Next one…", "句子。 下一句！"]


def test_a_sentence_past_the_budget_is_cut_at_clauses_then_spaces_then_anywhere():
    assert split_text("one, two, three; four", 10) == ["one, two,", "three;", "four"]
    assert split_text("alpha beta gamma delta", 11) == ["alpha beta", "gamma delta"]
    assert split_text("abcdefghij", 4) == ["abcd", "efgh", "ij"]
    with pytest.raises(ValueError, match="max_chars"):
        split_text("x", 0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "bc", "word", "abcdefghijkl", " ", "  ", "\n", ",", ".", "!", "?", ";", "。",
                                 "“", "”", "…"]), max_size=120).map("".join), st.integers(1, 60))
def test_segments_fit_and_keep_every_character_in_order(text, max_chars):
    segments = split_text(text, max_chars)
    assert all(0 < len(s) <= max_chars and s == s.strip() for s in segments)
    assert "".join("".join(segments).split()) == "".join(text.split())


def test_text_arriving_is_split_where_its_sentences_have_ended():
    from snac_fast.serve.lm.segments import ended_sentences

    assert ended_sentences("Hello there. How are") == ("Hello there. ", "How are")
    assert ended_sentences("Dr. Who? Yes.") == ("Dr. Who? ", "Yes.")  # the last mark may still go on ("Yes.com")
    assert ended_sentences("no end yet") == ("", "no end yet")
    assert ended_sentences("“Done!” next") == ("“Done!” ", "next")
    assert ended_sentences("好。再") == ("好。", "再")
