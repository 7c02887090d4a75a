"""Reasoning parsers: a thinking model's text -> its reasoning and its answer, as it streams.

One registry (`PARSERS`), named as vLLM's `--reasoning-parser` names them. The reasoning goes
out as `reasoning_content` (vLLM's field), the rest as `content`; the tool-call parser, if any,
reads only the content. Like the tool-call parsers, a reasoning parser returns the same split
whether its text comes whole or in pieces, holding back only what may still be a tag.
"""

from __future__ import annotations

from afd.tokenizer import ModelTokenizer
from services.gateway.tool_parsers import held_back


class ThinkParser:
    """Reasoning between <think> and </think> at the start of the output; the blanks around
    the tags belong to neither part. `opens_in_reasoning`: the output is reasoning from its
    first token even without <think> (the chat template wrote it), until </think>."""

    start_tag = "<think>"
    end_tag = "</think>"
    opens_in_reasoning = False

    def __init__(self) -> None:
        self._state = "start"  # start (has the output opened a think block?), reasoning, content
        self._buf = ""
        self._trim = False  # drop the blanks that follow a tag

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that this piece makes certain."""
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self._trim:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._trim = False
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(self.start_tag):
                    self._buf = head[len(self.start_tag) :]
                    self._state, self._trim = "reasoning", True
                elif not head or self.start_tag.startswith(head):
                    break  # may still be the tag
                else:
                    self._state = "reasoning" if self.opens_in_reasoning else "content"
                continue
            if self._state == "content":
                content.append(self._buf)
                self._buf = ""
                break
            end = self._buf.find(self.end_tag)
            if end >= 0:
                reasoning.append(self._buf[:end].rstrip())
                self._buf = self._buf[end + len(self.end_tag) :]
                self._state, self._trim = "content", True
                continue
            keep = held_back(self._buf, self.end_tag)
            sure = self._buf[: len(self._buf) - keep].rstrip()  # blanks may precede the tag
            reasoning.append(sure)
            self._buf = self._buf[len(sure) :]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output has ended."""
        buf, self._buf = self._buf, ""
        if self._state == "content" or (self._state == "start" and not self.opens_in_reasoning):
            return "", buf
        return buf, ""  # reasoning that never closed (max_tokens): it is still reasoning


class Qwen3Parser(ThinkParser):
    """Qwen3: a think block when the model opens one (with enable_thinking false its template
    writes an empty block into the prompt and the output is all content)."""


class DeepSeekR1Parser(ThinkParser):
    """DeepSeek-R1: its template opens the think block, so the output starts in reasoning."""

    opens_in_reasoning = True


class Step3Parser(DeepSeekR1Parser):
    """Step-3: as DeepSeek-R1, everything before </think> is reasoning."""


PARSERS: dict[str, type[ThinkParser]] = {
    "qwen3": Qwen3Parser,
    "deepseek_r1": DeepSeekR1Parser,
    "step3": Step3Parser,
}


def think_marker(parser: str, tokenizer: ModelTokenizer, prompt_ids: list[int]) -> tuple[int, ...]:
    """The tokens after which a guided answer's grammar holds under reasoning parser `parser`
    (its end tag, as vLLM starts structured outputs after the reasoning); () when the prompt
    already closed the thinking (Qwen3's template with enable_thinking false writes an empty
    block), so the grammar holds from the first token."""
    end = PARSERS[parser].end_tag
    if tokenizer.decode(prompt_ids[-32:], skip_special_tokens=False).rstrip().endswith(end):
        return ()
    return tuple(tokenizer.encode(end))
