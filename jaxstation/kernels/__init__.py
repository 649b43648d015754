"""The kernels under the model: the CPU matmul and decode attention kernels (C++ registered with XLA) and the
row-wise float sums whose result for a row never depends on how many rows there are."""
