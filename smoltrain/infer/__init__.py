"""Inference across hosts: one HF model split over ranks (pp by layers, tp by heads), batch-1 decode."""
