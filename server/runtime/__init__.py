"""The process-wide basics every other part stands on: the array backend (NumPy or CuPy, chosen
once), errors, the memory budget and expiry sweeps."""
