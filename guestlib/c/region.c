/* Region format v1: header and directory, validated exactly as Go's
 * shm/region DecodeHeader and DecodeEntry. */
#include "shunt.h"

#include <string.h>

#define SC __ATOMIC_SEQ_CST

/* As in Go's shm/region: MaxSlots bounds the directory a hostile header
 * can ask for, MinSize the smallest region, and a slot that keeps changing
 * under SEQLOCK_TRIES reads is stale (SHUNT_EAGAIN; ErrStale in Go: the
 * caller stays on TCP). */
#define MAX_SLOTS     (1u << 16)
#define MIN_SIZE      (64u << 10)
#define SEQLOCK_TRIES 8

static uint32_t le32(const uint8_t *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }
static uint64_t le64(const uint8_t *p) { return le32(p) | (uint64_t)le32(p + 4) << 32; }
static uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

int shunt_region_attach(struct shunt_region *g, void *mem, uint64_t mapped)
{
	const uint8_t *h = mem;
	memset(g, 0, sizeof *g);
	if (mapped < SHUNT_REGION_HEADER || memcmp(h, "SHUNTRG\0", 8) != 0 || le32(h + 8) != 1)
		return SHUNT_ECORRUPT;
	uint64_t size = le64(h + 16);
	uint32_t slots = le32(h + 24);
	if (size > mapped || slots < 1 || slots > MAX_SLOTS || size < MIN_SIZE || size % SHUNT_CHUNK)
		return SHUNT_ECORRUPT;
	uint64_t dir = SHUNT_REGION_HEADER;
	uint64_t heap = dir + round_up((uint64_t)slots * SHUNT_SLOT_SIZE, SHUNT_CHUNK);
	if (heap + 2 * SHUNT_CHUNK > size)
		return SHUNT_ECORRUPT;
	if (le32(h + 12) != SHUNT_REGION_HEADER || le32(h + 28) != SHUNT_SLOT_SIZE || le32(h + 56) != SHUNT_CHUNK ||
	    le64(h + 32) != dir || le64(h + 40) != heap || le64(h + 48) != size - heap)
		return SHUNT_ECORRUPT;
	g->mem = mem;
	g->size = size;
	g->slots = slots;
	g->dir_off = dir;
	g->heap_off = heap;
	g->heap_size = size - heap;
	return 0;
}

int shunt_region_slot(struct shunt_region *g, uint32_t i, struct shunt_slot *s)
{
	if (i >= g->slots)
		return SHUNT_ECORRUPT;
	uint8_t *b = g->mem + g->dir_off + (uint64_t)i * SHUNT_SLOT_SIZE;
	uint8_t c[SHUNT_SLOT_SIZE];
	for (int try = 0;; try++) {
		if (try == SEQLOCK_TRIES)
			return SHUNT_EAGAIN;
		uint32_t st = __atomic_load_n((uint32_t *)b, SC);
		uint64_t gen = __atomic_load_n((uint64_t *)(b + 8), SC);
		memcpy(c, b, sizeof c);
		if (__atomic_load_n((uint32_t *)b, SC) == st && __atomic_load_n((uint64_t *)(b + 8), SC) == gen) {
			memset(s, 0, sizeof *s);
			s->state = st;
			s->gen = gen;
			break;
		}
	}
	if (s->state > 3)
		return SHUNT_ECORRUPT;
	if (s->state < 2)
		return 0;
	s->reason = le32(c + 4);
	s->owner_a = le32(c + 16);
	s->owner_b = le32(c + 20);
	s->ring_ab = le64(c + 24);
	s->ring_ba = le64(c + 32);
	s->capacity = le64(c + 40);
	uint64_t cap = s->capacity;
	if (cap < SHUNT_RING_MIN || cap > SHUNT_RING_MAX || (cap & (cap - 1)))
		return SHUNT_ECORRUPT;
	uint64_t end = g->heap_off + g->heap_size;
	uint64_t pair = round_up(2 * (SHUNT_RING_HEADER + cap), SHUNT_CHUNK);
	if (s->ring_ab < g->heap_off || s->ring_ab % SHUNT_CHUNK || s->ring_ab > end || end - s->ring_ab < pair)
		return SHUNT_ECORRUPT;
	if (s->ring_ba != s->ring_ab + SHUNT_RING_HEADER + cap)
		return SHUNT_ECORRUPT;
	return 0;
}
