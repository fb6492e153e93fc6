"""Constants shared by the torch code and the Triton kernels (a leaf module: it imports nothing of the package)."""
import math

import torch

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
