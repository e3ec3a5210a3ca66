"""Measuring generated kernels: `lrdsl bench` beside FLA, held memory (`lrdsl memory`) and registers per kernel (`lrdsl resources`)."""
