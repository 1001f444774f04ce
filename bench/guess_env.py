"""bench/learn_env.py's game, an environment for `--env bench/guess_env.py:Guess` (or `:Blind`): find a hidden
whole number from 1 to 100 in at most 7 guesses. Guess answers each guess "higher", "lower" or "right"; Blind
plays the same game and answers "no answer" (the control: what is learnt without reading the replies)."""
import random

LIMIT = 7


class Guess:
    def reset(self, seed: int, **record) -> None:
        self.target = random.Random(seed).randint(1, 100)  # the record's seed: the same game on --resume
        self.guesses = 0
        self.won = False
        self.done = False

    def guess(self, n: int) -> str:
        """Guesses the hidden number.

        Args:
            n: a whole number from 1 to 100
        """
        self.guesses += 1
        self.won = n == self.target
        self.done = self.won or self.guesses >= LIMIT
        return "right" if self.won else "higher" if n < self.target else "lower"


class Blind(Guess):
    def guess(self, n: int) -> str:
        """Guesses the hidden number.

        Args:
            n: a whole number from 1 to 100
        """
        super().guess(n)
        return "no answer"


def won(completion, answer, env, **kw) -> float:  # --reward-fn bench/guess_env.py:won
    return float(env.won)
