def count_words(text):
    counts = {}
    for raw in text.split():
        word = raw.strip(".,;:!?").lower()
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts


def top_word(text):
    counts = count_words(text)
    if not counts:
        return None
    return min(counts, key=lambda word: (-counts[word], word))
