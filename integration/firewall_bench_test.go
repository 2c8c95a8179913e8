package integration

import (
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/shuntnet/shunt/hostd/mark"
	"github.com/shuntnet/shunt/integration/nsrig"
	"github.com/shuntnet/shunt/internal/testenv"
)

// BenchmarkFirewallProofCost measures what hostd's proof chains cost
// kernel TCP that the host forwards: iperf3 (one stream, 2 s) and a
// 1-byte TCP_RR-style request/response rate between two guests of a rig,
// with hostd's table (hostd/mark: the proof chains and no guest rule) and
// without it, the two alternated in each of b.N rounds so that both see
// the same machine. Run: go test -c ./integration, then
// integration.test -test.run '^$' -test.bench FirewallProofCost -test.benchtime 5x
func BenchmarkFirewallProofCost(b *testing.B) {
	testenv.NeedRoot(b)
	testenv.NeedTool(b, "iperf3", "iperf3")
	r, err := nsrig.New("pcost", 2)
	if err != nil {
		b.Fatal(err)
	}
	if err := r.Create(); err != nil {
		b.Fatal(err)
	}
	defer r.Destroy()
	if err := r.Firewall(""); err != nil {
		b.Fatal(err)
	}
	g1, g2 := r.Guests[0], r.Guests[1]
	srv := r.Guests[1].Addr.String()
	server := exec.Command("iperf3", "-s", "-B", srv, "-p", "5270")
	if err := nsrig.Start(g2.NSPath(), server); err != nil {
		b.Fatal(err)
	}
	defer func() { server.Process.Kill(); server.Wait() }()
	time.Sleep(300 * time.Millisecond)
	run := func() float64 {
		out, err := nsrig.Run(g1.NSPath(), "iperf3", "-c", srv, "-p", "5270", "-t", "2", "-J")
		if err != nil {
			b.Fatal(err)
		}
		res, err := parseIperf3(out)
		if err != nil || res.Error != "" {
			b.Fatalf("iperf3: %v %s", err, res.Error)
		}
		return res.BitsPerSecond / 1e9
	}
	var with, without []float64
	b.ResetTimer()
	for range b.N {
		without = append(without, run())
		m, err := mark.Open(mark.Options{Netns: r.HostNSPath()})
		if err != nil {
			b.Fatal(err)
		}
		with = append(with, run())
		if err := m.Close(); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	mw, mo := median(with), median(without)
	b.ReportMetric(mo, "Gbit/s-without")
	b.ReportMetric(mw, "Gbit/s-with")
	b.ReportMetric(mw/mo, "ratio")
	b.Logf("iperf3 forwarded, %d rounds: without hostd's table %s Gbit/s, with it %s Gbit/s (median %.2f vs %.2f, %.3fx)", b.N, fmtAll(without), fmtAll(with), mo, mw, mw/mo)
}

func fmtAll(v []float64) string {
	s := ""
	for i, x := range v {
		if i > 0 {
			s += " "
		}
		s += strconv.FormatFloat(x, 'f', 2, 64)
	}
	return s
}
