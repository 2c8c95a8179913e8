// Package mpi holds btl/shunt, Shunt's transport for Open MPI: a byte
// transfer layer (BTL) component for ob1, built out of tree against the
// distribution's Open MPI 4.1 as mca_btl_shunt.so, and shunt-mpirun, the
// script that runs mpirun with it (docs/mpi.md).
//
// The component is the C core in guestlib/c (rings and records in them,
// region, control protocol, the session with hostd, VM discovery) plus the
// files in csrc/: the component and its progress loop (component.c), ob1's
// entry points (module.c), connections, the lease connect, accept and HELLO
// (conn.c), lease I/O (lease.c), the path of each direction between lease
// and ring (handover.c), and the session's use (hostd.c); btl_shunt.h
// describes them. The C files sit in csrc/ because the go command refuses
// C files in a package that does not use cgo.
//
// make mpi builds the component and the script into bin/, with the
// Makefile's one set of compiler flags. The ring records are the core's,
// tested with it (guestlib/preload/records_test.go). MPI jobs across
// namespace guests and VMs are tested in integration/mpi_btl_test.go, and
// measured in integration/mpi_bench_test.go (make bench-mpi).
package mpi
