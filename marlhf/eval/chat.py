"""A multi-turn conversation with a policy in its task's dialogue format.

The history is kept as text in the task's raw format (``marlhf/applications/<task>/``: HH's "\\n\\nHuman: …
\\n\\nAssistant: …" for dialogue), each earlier turn followed by the answer the policy gave; the policy's
recorded prompt format then applies as everywhere else (a chat-template model sees the same turns as chat
messages).  Answers are sampled through the generation seam and post-processed by the task (cut at the next
"\\n\\nHuman:", stripped).
"""

from __future__ import annotations

from marlhf.data.formatting import LongPromptPolicy
from marlhf.eval.generate_tool import LoadedPolicy, batch_seed
from marlhf.sections import SamplingSection, ScheduleSection


class ChatSession:
    def __init__(self, policy: LoadedPolicy, application, sampling: SamplingSection | None = None, *,
                 greedy: bool = False, seed: int = ScheduleSection.seed):
        """``sampling``: the tool's sampling flags (None: their defaults, step 3's)."""
        self.policy, self.app = policy, application
        self.sampling, self.greedy = sampling or SamplingSection(), greedy
        self.max_prompt_len = self.sampling.max_prompt_len
        self.seed = seed
        self.history: list[tuple[str, str]] = []  # (user turn, the policy's answer)
        self.turns = 0  # answers given in this process: each samples under its own seed

    def raw_prompt(self, user: str) -> str:
        """The conversation so far plus ``user``'s turn, in the task's raw format."""
        past = "".join(self.app.format_prompt(u) + " " + a for u, a in self.history)
        return past + self.app.format_prompt(user)

    def model_input(self, user: str) -> str:
        """The text the model reads: the raw prompt in the policy's prompt format, over-long history cut from
        the oldest turns as step 3 cuts long prompts."""

        text, drop = LongPromptPolicy("truncate").fit(self.policy.formatter, self.raw_prompt(user), self.max_prompt_len)
        return text + (f"\n(its first {drop} tokens are cut: over --max_prompt_len)" if drop else "")

    def reply(self, user: str) -> str:
        cfg = self.policy.config(self.sampling, do_sample=not self.greedy, seed=batch_seed(self.seed, self.turns))
        responses, _, _ = self.policy.sample([self.raw_prompt(user)], cfg, 1, self.max_prompt_len)
        answer = self.app.postprocess(responses[0])
        self.history.append((user, answer))
        self.turns += 1
        return answer

    def reset(self) -> None:
        self.history.clear()
