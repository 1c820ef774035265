/* Batch augmentation for small images (random crop with zero padding, horizontal flip) and per-channel normalisation. */
#ifndef DLUA_DATA_AUGMENT_H
#define DLUA_DATA_AUGMENT_H
#include <stdint.h>
#include "core/api.h"

/* Philox counter word 3 of augmentation draws is (epoch >> 32) ^ this tag ("AUG1"), which
   keeps them apart from generator fills (word 3 = 0) that share the seed. */
#define DLUA_AUGMENT_STREAM_TAG 0x41554731u

/* A sample's draws: crop offsets dy, dx in [0, 2 pad] and whether to flip, as functions of
   (seed, epoch, sample index) alone. The tests recompute them from this. */
void dlua_augment_draw(uint64_t seed, uint64_t epoch, int64_t sample, int64_t pad, double flip_p, int64_t *dy,
                       int64_t *dx, int *flip);

#endif
