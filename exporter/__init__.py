"""gpuio: is this GPU idle because its engine or its data cannot come off the disk fast enough?"""

__version__ = "0.1.0"
