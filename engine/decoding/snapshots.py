"""When the prefix cache gets a snapshot: the one policy that `Generation` (generate.py) and the
decode batch (engine/scheduling/batch.py) both follow.

A prefill stops (ends its chunk early and evaluates) only where a snapshot will be taken; every
other stretch of the prompt goes through the model in large chunks, because each stop costs a
device sync and each snapshot a copy.

- A trimmable cache (every layer a `KVCache`: dense models) serves any shorter prefix from a longer
  snapshot, so its prompt needs no stop at all: the snapshots at the prompt's end and at the answer's
  end serve every message end before them.
- A non-trimmable cache (linear-attention state) is valid only at the exact length where it was
  taken. Its prompt stops at the end of the first message (the system prompt, shared by new
  conversations), at the last `recent_messages` message ends before the prompt's end (an edited or
  regenerated last turn resumes there), at the point where the prompt left the tokens already
  cached (the branch point, as Ollama's MLX runner keeps one), and one token before its end (a
  repeated prompt re-runs only its last token). A conversation that grows turn by turn still gets
  a snapshot at every message end, since each turn prefills only its newest messages.

Stops depend only on the prompt, the cache's kind and the branch point, never on whether a prefix
cache is attached, so a warm resume starts on a boundary the cold run also had.
"""

from dataclasses import dataclass

from .chat import Prompt


@dataclass(frozen=True)
class SnapshotPolicy:
    """Where prefill stops for a snapshot, and which finished requests leave one."""

    recent_messages: int = 2

    def prefill_stops(self, prompt: Prompt, start: int, trimmable: bool, branch: int = 0) -> list[int]:
        """Ascending prompt positions in (start, len - 1] where prefill ends a chunk and saves the
        cache (the prompt's last token is fed with the first decode step, then the whole prompt is
        saved). `branch`: how many tokens the prompt shares with what the prefix cache holds."""
        last = len(prompt.tokens) - 1
        if trimmable:
            return []
        ends = [c for c in prompt.checkpoints if c < last]
        points = set(ends[:1] + ends[len(ends) - self.recent_messages:]) | {branch, last}
        return sorted(p for p in points if start < p <= last)

    @staticmethod
    def save_at_finish(finish_reason: str | None) -> bool:
        """A request that ended normally leaves its prompt + answer (a cancelled or failed one does
        not: its last step may not have completed)."""
        return finish_reason in ("stop", "length", "tool_calls")


POLICY = SnapshotPolicy()
