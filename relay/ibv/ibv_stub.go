//go:build !rdma || !cgo || !linux

package ibv

import "github.com/shuntnet/shunt/relay"

// Open is not available in this build.
func Open(Config) (relay.Verbs, error) { return nil, ErrNoRDMA }
