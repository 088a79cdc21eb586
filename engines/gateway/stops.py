"""Stop strings: OpenAI's ``stop`` served by engines that stop only at token ids.

    stops = StopStrings(codec, request.stop_strings())
    engine_request.stop_token_ids = stops.engine_stop_ids   # the codec's end ids + one-token stop strings
    out = stops.apply(output_ids, logprobs, policy_versions, finish_reason)   # a StoppedOutput

A stop string that is one token goes to the engine as a stop id: the engine ends on it, and the text before
it is shown. A longer one (or one that shows up earlier, inside a merged token) cuts the output after the
first token whose text completes it, so the recorded ids stay a prefix of what the engine sampled (every
recorded id was sampled by the policy) while the harness sees the text before the stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.gateway.codec import ChatCodec


@dataclass
class StoppedOutput:
    """An engine output after stop strings: what is recorded (ids, logprobs, versions) and shown (text)."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str  # decoded, stop token / stop string excluded
    finish_reason: str
    cut: bool  # the output was shortened after a stop string's last token


class StopStrings:
    def __init__(self, codec: ChatCodec, strings: list[str]):
        self.codec = codec
        self.strings = list(strings)
        stop_ids = dict.fromkeys(codec.stop_ids)
        self.token_stops: dict[int, str] = {}  # one-token stop strings, by id
        for text in self.strings:
            ids = codec.encode(text)
            if len(ids) == 1 and codec.decode(ids) == text:
                self.token_stops[ids[0]] = text
                stop_ids[ids[0]] = None
        self.engine_stop_ids: list[int] = list(stop_ids)

    def apply(self, ids: list[int], logprobs: list[float], versions: list[int], finish: str) -> StoppedOutput:
        codec, strings = self.codec, self.strings
        if finish == "stop" and ids and ids[-1] in self.token_stops and ids[-1] not in codec.stop_ids:
            before = codec.decode(ids[:-1])
            if not any(s in before for s in strings):
                return StoppedOutput(ids, logprobs, versions, before, "stop", cut=False)
        text = codec.decode(ids)
        if not any(s in text for s in strings):
            return StoppedOutput(ids, logprobs, versions, text, finish, cut=False)

        def has_stop(n: int) -> bool:
            prefix = codec.decode(ids[:n])
            return any(s in prefix for s in strings)

        low, high = 1, len(ids)  # the shortest prefix of ids whose text holds a stop string
        while low < high:
            middle = (low + high) // 2
            if has_stop(middle):
                high = middle
            else:
                low = middle + 1
        prefix = codec.decode(ids[:low])
        cut_at = min(prefix.find(s) for s in strings if s in prefix)
        return StoppedOutput(ids[:low], logprobs[:low], versions[:low], prefix[:cut_at], "stop", cut=True)
