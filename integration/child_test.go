package integration

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/integration/perf"
)

// child is a guest process started by a test or benchmark inside a guest
// namespace, selected by SHUNT_E2E_CHILD:
//
//	writer  dial SHUNT_E2E_ADDR through guestlib and write until killed
//	setup   dial SHUNT_E2E_ADDR (SHUNT_E2E_STACK kernel or shunt) SHUNT_E2E_N
//	        times with perf.SetupSamples; print the median in nanoseconds
//	        and the connections per second, close included
//	ctlflood  a hostile neighbour's control-plane flood (hostile_control_test.go)
//	echo    listen on SHUNT_E2E_ADDR (SHUNT_E2E_STACK = kernel, busypoll or
//	        shunt), print "ready", and echo SHUNT_E2E_SIZE-byte messages on
//	        each connection; a connection whose first byte is 's' is a sink
//	        instead: read to EOF, then write the byte count as a line
//	http    listen on SHUNT_E2E_ADDR (SHUNT_E2E_STACK kernel or shunt),
//	        print "ready", and serve GET /N with an N-byte body and POST
//	        with the body's length (http_bench_test.go)
func child() int {
	addr := os.Getenv("SHUNT_E2E_ADDR")
	switch os.Getenv("SHUNT_E2E_CHILD") {
	case "writer":
		c, err := guestlib.DialContext(context.Background(), "tcp4", addr)
		if err != nil {
			fmt.Fprintln(os.Stderr, "dial:", err)
			return 1
		}
		fmt.Println(c.Path())
		buf := make([]byte, 64<<10)
		for {
			if _, err := c.Write(buf); err != nil {
				fmt.Fprintln(os.Stderr, "write:", err)
				return 1
			}
		}
	case "setup":
		n, _ := strconv.Atoi(os.Getenv("SHUNT_E2E_N"))
		dial := func() (net.Conn, error) { return net.Dial("tcp4", addr) }
		if os.Getenv("SHUNT_E2E_STACK") == "shunt" {
			dial = func() (net.Conn, error) { return guestlib.Dial("tcp4", addr) }
		}
		start := time.Now()
		ds, err := perf.SetupSamples(dial, n, 8)
		if err != nil {
			fmt.Fprintln(os.Stderr, "setup:", err)
			return 1
		}
		fmt.Println(perf.Median(ds).Nanoseconds(), float64(n)/time.Since(start).Seconds())
		return 0
	case "ctlflood":
		return ctlFloodChild()
	case "http":
		return httpChild(addr, os.Getenv("SHUNT_E2E_STACK"))
	case "echo":
		size, _ := strconv.Atoi(os.Getenv("SHUNT_E2E_SIZE"))
		stack := os.Getenv("SHUNT_E2E_STACK")
		l, err := perf.Listen(stack, addr)
		if err != nil {
			fmt.Fprintln(os.Stderr, "listen:", err)
			return 1
		}
		fmt.Println("ready")
		perf.Serve(l, size, stack == "busypoll")
		return 1
	}
	return 2
}
