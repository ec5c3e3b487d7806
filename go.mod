module github.com/llmq/llmq

go 1.26.8

require (
	github.com/ardanlabs/jinja v1.8.0
	github.com/dlclark/regexp2 v1.12.0
	github.com/nlpodyssey/safetensors v0.0.0-20250209183917-bfb01cc25f7c
	github.com/sashabaranov/go-openai v1.43.0
	github.com/spf13/cobra v1.10.2
	github.com/spf13/pflag v1.0.9
	github.com/x448/float16 v0.8.4
	golang.org/x/text v0.44.0
	gonum.org/v1/gonum v0.17.0
	gonum.org/v1/plot v0.17.0
)

require (
	codeberg.org/go-fonts/liberation v0.5.0 // indirect
	codeberg.org/go-latex/latex v0.2.0 // indirect
	codeberg.org/go-pdf/fpdf v0.11.1 // indirect
	git.sr.ht/~sbinet/gg v0.7.0 // indirect
	github.com/ajstarks/svgo v0.0.0-20211024235047-1546f124cd8b // indirect
	github.com/golang/freetype v0.0.0-20170609003504-e2365dfdc4a0 // indirect
	github.com/inconshreveable/mousetrap v1.1.0 // indirect
	golang.org/x/image v0.30.0 // indirect
)
