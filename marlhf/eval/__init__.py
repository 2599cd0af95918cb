"""Evaluation: pass@k for programs, pairwise judges and their win rates."""
