"""Values the TIR kernels share."""

# a score below every real one, standing for -inf in a running max and softmax, but finite: the max,
# the difference and exp() of it stay well defined (exp underflows to 0)
LOWEST = -3.0e38
