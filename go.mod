module github.com/shuntnet/shunt

go 1.26.0

require golang.org/x/sys v0.50.0

require go.uber.org/goleak v1.3.0 // indirect
