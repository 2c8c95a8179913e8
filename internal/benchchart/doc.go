// Package benchchart draws the charts of docs/BENCHMARKS.md from the raw
// output of `go test -bench` that the Makefile's bench-* targets collect in
// bin/bench-*.txt.
//
// The pipeline has three pure steps and one drawing step:
//
//	raw output --Parse--> Set --Build(Rules, Specs)--> []Chart --WriteSVG--> docs/charts/*.svg
//	(rounds of lines)     (samples per             (series of medians,
//	                       benchmark and unit)      one chart per Spec)
//
// Parse reads the Go benchmark format (configuration lines such as
// "cpu: AMD EPYC", then lines "BenchmarkName/sub-2  N  v unit  v unit ...")
// and keeps every round's value per (benchmark, unit); the "-2" GOMAXPROCS
// suffix is dropped, as benchstat does. Build takes the median over rounds of
// each (benchmark, unit), the figure benchstat prints, and places it in a
// chart by the first Rule whose name and unit patterns match:
//
//   - the name pattern's group "series" names the line or bar group; known
//     keys (kernel, busypoll, shunt, vader, tcp-veth, virtio-net, spin, ...)
//     get a label and a fixed colour from Transports, so a transport looks
//     the same in every chart, and unknown keys are charted under their own
//     name;
//   - the group "x", in the name or in the unit (as in "us@8B"), is the x
//     value: a message size ("8B", "64K", "4KiB", "1MiB", "64000",
//     "size=64") on a size chart, a category otherwise (the wait modes of
//     BenchmarkIdleCPU); Rule.X gives it when neither has one, e.g. 8 B for
//     BenchmarkAtomicPingPong or 14 B for sockperf, whose sizes are fixed
//     in the benchmark code.
//
// So a new sub-benchmark (another size, another transport) shows up in its
// chart with no change here, and a new benchmark needs one line in Rules.
// Figures no rule charts are reported by Build, never dropped silently;
// ns/op, B/op and allocs/op are the only units left out without a rule,
// because every benchmark here reports its domain figure with
// b.ReportMetric.
//
// The charts, by make target (see Specs):
//
//	bench-shm      shm-latency, shm-bandwidth, shm-ringsize, shm-idle-cpu
//	bench-e2e      e2e-latency, e2e-bandwidth, e2e-setup
//	bench-preload  preload-mpi-latency, preload-mpi-bandwidth,
//	               preload-sockperf-latency, preload-sockperf-bandwidth,
//	               preload-iperf3
//	bench-vm       vm-latency, vm-bandwidth
//
// Size charts draw lines over a log-scaled size axis, ticked at the sizes
// measured (0 B, as in MPI's latency, sits an eighth of the smallest size to
// the left); a size chart whose
// data has a single size, and every category chart, draws grouped bars with
// their values written on them. Latency charts use a log y axis when the
// data spans 10x or more. Every chart has a legend naming each transport
// and a footnote with the command, the machine and the number of rounds. Output is deterministic: the same input gives
// the same bytes.
package benchchart
