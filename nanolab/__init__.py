"""nanolab: train nanoGPT-scale language models with PyTorch Lightning, keeping every GPU-hour busy."""

__version__ = "0.1.0"
