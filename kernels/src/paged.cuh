// Paged-cache addressing shared by the kernels.
#pragma once

// Block and offset of a non-negative logical position: a shift and a mask for the power-of-two block sizes
// caches use (GLM-5: 64), a division otherwise. The test is uniform across the grid.
__device__ __forceinline__ int2 page_of(int position, int block_size) {
    if ((block_size & (block_size - 1)) == 0) {
        const int shift = __ffs(block_size) - 1;
        return make_int2(position >> shift, position & (block_size - 1));
    }
    return make_int2(position / block_size, position % block_size);
}
