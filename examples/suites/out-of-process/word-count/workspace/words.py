def count_words(text):
    raise NotImplementedError


def top_word(text):
    raise NotImplementedError
