"""A deterministic, English-and-code-like corpus to train the policy tokenizer on.

The policy model starts from random weights, so its tokenizer does not need real text: it needs
text with the statistics an agent sees (instructions, Python, shell output, JSON tool calls and
their results) so that common pieces of those become single tokens. Real function words and
programming words are mixed with a seeded lexicon of pronounceable pseudo-words drawn with Zipf
frequencies, which gives BPE enough distinct words for an 8k vocabulary in a few hundred KB.

`generate_corpus(seed)` returns the same documents for the same seed on every machine (only
`random.Random` and the fixed lists below are used). The chat-template markers are special tokens
and never appear here.
"""

from __future__ import annotations

import itertools
import json
import random


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


CORPUS_SEED = 0
"""The seed of the corpus every preset's tokenizer is trained on (tokenizers do not vary with --seed)."""

DEFAULT_CORPUS_BYTES = 400_000
LEXICON_SIZE = 12000
ZIPF_EXPONENT = 0.75

_FUNCTION_WORDS = _words(
    "the a an of to in for on with by from at as is are was be it this that these those and or but not "
    "if then so when while which who what how all each every some any no more most other only same"
)
_NOUNS = _words(
    "file function test module class config value list dictionary string number error result output "
    "input user request response server client database table column row query index cache buffer "
    "token model batch step loss gradient tree node path branch commit repository package version "
    "directory folder script command argument option flag log message warning exception problem "
    "answer question summary report record key field schema type method variable loop parser"
)
_VERBS = _words(
    "add remove update fix write read open close check find return print parse load save run build "
    "install test create delete rename move copy count sort filter merge split format compute list "
    "explain describe refactor implement debug validate convert"
)
_ADJECTIVES = _words(
    "new old small large empty missing broken failing correct simple long short first last next "
    "previous current default local remote hidden public private temporary final main"
)
_CONNECTIVES = _words("and then so that because when if but before after while until unless since although")
_EXTENSIONS = ("py", "txt", "json", "md", "toml", "yaml", "csv", "sh", "log", "cfg")
_COMMANDS = ("ls", "cat", "grep", "python", "pytest", "git", "pip", "find", "sed", "wc", "head", "make")
_TOOLS = (
    ("run_shell", {"command": "str", "timeout": "int"}),
    ("read_file", {"path": "str", "start_line": "int", "end_line": "int"}),
    ("write_file", {"path": "str", "content": "str"}),
    ("search", {"query": "str", "max_results": "int"}),
    ("edit_file", {"path": "str", "old": "str", "new": "str"}),
    ("submit", {"answer": "str"}),
)
_UNICODE = (
    "café",
    "naïve",
    "über",
    "façade",
    "résumé",
    "日本語",
    "中文",
    "Ελληνικά",
    "→",
    "✓",
    "😀",
    "—",
    "…",
)
_ONSETS = (
    "", "", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
    "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gl", "gr", "pl", "pr", "sc", "sh", "sk", "sl",
    "sp", "st", "str", "th", "tr", "wh",
)  # fmt: skip
_NUCLEI = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "ai", "ea", "ee", "oo", "ou", "ie", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "nt", "st", "ck", "ng", "rt", "ll", "ss", "x", "th")
_SUFFIXES = ("", "", "", "", "s", "ing", "ed", "er", "ly", "tion", "ment", "ness", "able", "al", "ize")


def generate_corpus(seed: int = CORPUS_SEED, target_bytes: int = DEFAULT_CORPUS_BYTES) -> list[str]:
    """Documents (instructions, code, shell output, tool calls) totalling about ``target_bytes``."""
    writer = _Writer(random.Random(seed))
    makers = (
        writer.instruction,
        writer.python,
        writer.python,
        writer.shell,
        writer.tool_call,
        writer.tool_result,
        writer.prose,
    )
    documents: list[str] = []
    size = 0
    while size < target_bytes:
        document = writer.rng.choice(makers)()
        documents.append(document)
        size += len(document.encode())
    return documents


class _Writer:
    """Draws words (real ones, or Zipf-distributed pseudo-words) and assembles documents from them."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        lexicon = sorted({self._pseudo_word() for _ in range(LEXICON_SIZE)})
        rng.shuffle(lexicon)  # rank order must not be alphabetical
        self.lexicon = lexicon
        self.cum_weights = list(
            itertools.accumulate(rank**-ZIPF_EXPONENT for rank in range(1, len(lexicon) + 1))
        )

    def _pseudo_word(self) -> str:
        syllables = self.rng.choice((1, 2, 2, 2, 3, 3))
        word = "".join(
            self.rng.choice(_ONSETS) + self.rng.choice(_NUCLEI) + self.rng.choice(_CODAS)
            for _ in range(syllables)
        )
        return word + self.rng.choice(_SUFFIXES)

    # -- words ---------------------------------------------------------------------------------
    def word(self, real: tuple[str, ...] = _NOUNS, p_real: float = 0.4) -> str:
        if self.rng.random() < p_real:
            return self.rng.choice(real)
        return self.rng.choices(self.lexicon, cum_weights=self.cum_weights)[0]

    def identifier(self) -> str:
        parts = [self.word(p_real=0.5) for _ in range(self.rng.choice((1, 1, 2, 2, 3)))]
        style = self.rng.random()
        if style < 0.7:
            return "_".join(parts)
        if style < 0.9:
            return parts[0] + "".join(p.title() for p in parts[1:])
        return "".join(p.title() for p in parts)

    def file_name(self) -> str:
        return self.identifier() + "." + self.rng.choice(_EXTENSIONS)

    def path(self) -> str:
        folders = [self.word(("src", "tests", "lib", "docs", *_NOUNS)) for _ in range(self.rng.randint(0, 3))]
        return "/".join([*folders, self.file_name()])

    def sentence(self) -> str:
        rng = self.rng
        words = [self.word(_VERBS), rng.choice(_FUNCTION_WORDS), self.word(_ADJECTIVES, 0.5), self.word()]
        for _ in range(rng.randint(1, 5)):
            words += [rng.choice(_CONNECTIVES + _FUNCTION_WORDS), self.word(_VERBS, 0.5)]
            words += [rng.choice(_FUNCTION_WORDS), self.word()]
        if rng.random() < 0.3:
            words += ["in", f"`{self.path()}`"]
        if rng.random() < 0.1:
            words.append(rng.choice(_UNICODE))
        text = " ".join(words)
        return text[0].upper() + text[1:] + rng.choice((".", ".", ".", "?", "!", ":"))

    # -- documents -----------------------------------------------------------------------------
    def instruction(self) -> str:
        rng = self.rng
        opening = rng.choice(
            ("Please", "Can you", "I need you to", "Your task is to", "You are working in a repository.")
        )
        body = " ".join(self.sentence() for _ in range(rng.randint(1, 4)))
        tail = rng.choice(("", " Run the tests when you are done.", " Reply with the final answer only."))
        return f"{opening} {body[0].lower()}{body[1:]}{tail}\n"

    def prose(self) -> str:
        rng = self.rng
        lines = []
        if rng.random() < 0.5:
            lines.append("#" * rng.randint(1, 3) + " " + self.word(_ADJECTIVES).title() + " " + self.word())
        for _ in range(rng.randint(1, 4)):
            bullet = rng.choice(("", "- ", "* ", f"{rng.randint(1, 9)}. "))
            lines.append(bullet + " ".join(self.sentence() for _ in range(rng.randint(1, 3))))
        return "\n".join(lines) + "\n\n"

    def expression(self, names: list[str]) -> str:
        rng = self.rng
        name = rng.choice(names)
        return rng.choice(
            (
                f"{name} + {rng.randint(0, 99)}",
                f"len({name})",
                f"{name}[{rng.randint(0, 9)}]",
                f"{name}.get({json.dumps(self.identifier())})",
                f"sorted({name}, key=lambda x: x[{rng.randint(0, 2)}])",
                f'f"{{{name}}} {self.word()}s"',
                f"{name} * {rng.random():.3f}",
                f"[x for x in {name} if x]",
                f"{name} is None",
                f"{self.identifier()}({name}, {rng.choice(names)})",
                f"{name}.{self.identifier()}()",
            )
        )

    def statement(self, names: list[str], indent: str) -> list[str]:
        rng = self.rng
        target = self.identifier()
        names.append(target)
        kind = rng.random()
        if kind < 0.45:
            return [f"{indent}{target} = {self.expression(names)}"]
        if kind < 0.6:
            return [
                f"{indent}for {target} in {rng.choice(names)}:",
                f"{indent}    {rng.choice(names)} += {self.expression(names)}",
            ]
        if kind < 0.75:
            return [f"{indent}if {self.expression(names)}:", f"{indent}    return {self.expression(names)}"]
        if kind < 0.85:
            return [f"{indent}print({self.expression(names)})"]
        if kind < 0.93:
            error = rng.choice(("ValueError", "KeyError", "OSError", "Exception"))
            return [
                f"{indent}try:",
                f"{indent}    {target} = {self.expression(names)}",
                f"{indent}except {error} as error:",
                f'{indent}    raise RuntimeError(f"cannot {self.word(_VERBS)} {{error}}") from error',
            ]
        return [f"{indent}# {self.sentence().lower()}"]

    def python(self) -> str:
        rng = self.rng
        lines: list[str] = []
        if rng.random() < 0.4:
            module = rng.choice(("os", "sys", "json", "re", "math", "random", "pathlib", "typing"))
            lines += [f"import {module}", f"from {self.identifier()} import {self.identifier()}", ""]
        params = [self.identifier() for _ in range(rng.randint(0, 3))]
        types = ("int", "str", "list[int]", "dict[str, int]", "float", "bool")
        hints = [f"{p}: {rng.choice(types)}" for p in params]
        names = list(params) or ["self"]
        indent = "    "
        if rng.random() < 0.3:
            lines += [
                f"class {self.identifier().title().replace('_', '')}:",
                f'    """{self.sentence()}"""',
                "",
            ]
            hints = ["self", *hints]
            indent = "        "
        returns = rng.choice(("int", "str", "None", "list[str]", "bool", "dict[str, Any]"))
        lines.append(
            f"{indent[4:]}def {self.word(_VERBS)}_{self.identifier()}({', '.join(hints)}) -> {returns}:"
        )
        if rng.random() < 0.6:
            lines.append(f'{indent}"""{self.sentence()}"""')
        for _ in range(rng.randint(2, 8)):
            lines += self.statement(names, indent)
        lines.append(f"{indent}return {self.expression(names)}")
        return "\n".join(lines) + "\n\n"

    def shell(self) -> str:
        rng = self.rng
        kind = rng.random()
        if kind < 0.25:
            out = [f"$ ls -la {self.word()}", f"total {rng.randint(4, 400)}"]
            for _ in range(rng.randint(2, 8)):
                month = rng.choice(("Jan", "Feb", "Mar", "Sep", "Oct"))
                out.append(
                    f"-rw-r--r-- 1 user user {rng.randint(0, 99999):>6} {month} {rng.randint(1, 28):>2} "
                    f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d} {self.file_name()}"
                )
        elif kind < 0.45:
            passed, failed = rng.randint(0, 200), rng.randint(0, 5)
            out = [
                "$ python -m pytest -q",
                "." * rng.randint(5, 60) + "F" * failed,
                f"{passed} passed, {failed} failed in {rng.random() * 30:.2f}s",
            ]
            if failed:
                out.insert(
                    2, f"FAILED tests/test_{self.identifier()}.py::test_{self.identifier()} - AssertionError"
                )
        elif kind < 0.6:
            error = rng.choice(("KeyError", "IndexError", "TypeError", "ValueError"))
            out = [
                "Traceback (most recent call last):",
                f'  File "{self.path()}", line {rng.randint(1, 500)}, in {self.identifier()}',
                f"    {self.identifier()} = {self.identifier()}[{rng.randint(0, 9)}]",
                f"{error}: {self.sentence().lower()}",
            ]
        elif kind < 0.75:
            out = ["$ git status", f"On branch {self.identifier()}", "Changes not staged for commit:"]
            out += [f"\tmodified:   {self.path()}" for _ in range(rng.randint(1, 5))]
        elif kind < 0.9:
            out = [f"$ grep -rn {self.identifier()} ."]
            out += [
                f"./{self.path()}:{rng.randint(1, 900)}:    {self.identifier()} = {self.identifier()}"
                for _ in range(rng.randint(1, 6))
            ]
        else:
            command = rng.choice(_COMMANDS)
            status = rng.choice(("No such file or directory", "Permission denied", "done", "ok"))
            out = [
                f"$ {command} --{self.word()} {self.path()}",
                f"{command}: {self.word(_ADJECTIVES)} {self.word()}: {status}",
                f"exit code {rng.choice((0, 0, 1, 2, 127))}",
            ]
        return "\n".join(out) + "\n"

    def arguments(self, schema: dict[str, str]) -> dict[str, object]:
        arguments: dict[str, object] = {}
        for name, kind in schema.items():
            if self.rng.random() < 0.25 and arguments:
                continue  # optional arguments are often left out
            if kind == "int":
                arguments[name] = self.rng.randint(1, 600)
            elif name == "command":
                arguments[name] = f"{self.rng.choice(_COMMANDS)} {self.path()}"
            elif name == "path":
                arguments[name] = self.path()
            else:
                arguments[name] = self.sentence()
        return arguments

    def tool_call(self) -> str:
        name, schema = self.rng.choice(_TOOLS)
        call = json.dumps({"name": name, "arguments": self.arguments(schema)}, ensure_ascii=False)
        lead = self.sentence() + "\n" if self.rng.random() < 0.4 else ""
        return f"{lead}{call}\n"

    def tool_result(self) -> str:
        rng = self.rng
        if rng.random() < 0.5:
            return self.shell()
        result = {
            "ok": rng.random() < 0.8,
            "path": self.path(),
            "lines": rng.randint(0, 4000),
            "matches": [
                {"line": rng.randint(1, 900), "text": self.sentence()} for _ in range(rng.randint(0, 3))
            ],
        }
        return json.dumps(result, ensure_ascii=False, indent=rng.choice((None, 2))) + "\n"
