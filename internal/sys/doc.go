// Package sys holds the few raw system calls Shunt needs: anonymous shared
// memory (memfd), mapping files, and futexes on shared mappings. Keeping them
// here lets the ring and region code stay plain Go over byte slices.
//
// Everything is Linux-only; on other systems each call returns ErrUnsupported,
// so the module still builds there.
package sys
