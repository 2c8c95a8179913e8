// Package shmtest provides shared memory for tests of Shunt's rings and
// regions: aligned plain memory, memfd-backed regions, and rings ready to use,
// all cleaned up with the test.
package shmtest
