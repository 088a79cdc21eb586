"""Hidden checks: the probe calls the agent's code in the sandbox; the expected values stay here."""

import words


def check_counts():
    expect_equal(words.count_words("a b a"), {"a": 2, "b": 1}, "count_words('a b a')")


def check_case_and_punctuation():
    expect_equal(words.count_words("Yes, yes! NO."), {"yes": 2, "no": 1}, "case and punctuation")


def check_empty():
    expect_equal(words.count_words(" ... "), {}, "no words")


def check_top_word():
    expect_equal(words.top_word("b a b a c"), "a", "tie goes to the first word")
    expect_equal(words.top_word(""), None, "no words, no top word")
