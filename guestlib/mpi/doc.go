// Package mpi holds btl/shunt, Shunt's transport for Open MPI: a byte
// transfer layer (BTL) component for ob1, built out of tree against the
// distribution's Open MPI 4.1 as mca_btl_shunt.so, and shunt-mpirun, the
// script that runs mpirun with it (docs/mpi.md).
//
// The component is the C core in guestlib/c (rings, region, control
// protocol, the session with hostd, VM discovery) plus the files in csrc/:
// the component and its progress loop (component.c), ob1's entry points
// (module.c), connections and the path of each direction between lease and
// ring (conn.c), the session's use (hostd.c), and records in a ring, in
// place (records.c); btl_shunt.h describes them. The C files sit in csrc/
// because the go command refuses C files in a package that does not use
// cgo.
//
// make mpi builds the component and the script into bin/, with the
// Makefile's one set of compiler flags; make mpi-xtest builds the unit
// tests of the ring records (xtest/records_test.c), which the Go test here
// runs over plain memory, without root, hostd or MPI. MPI jobs across
// namespace guests and VMs are tested in integration/mpi_btl_test.go, and
// measured in integration/mpi_bench_test.go (make bench-mpi).
package mpi
